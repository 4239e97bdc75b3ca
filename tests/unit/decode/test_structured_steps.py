"""Decode's loop with constrained and unconstrained sequences in one batch, on the real model and pool: each
constrained one writes JSON its schema accepts and ends (STOP) once it is complete, its grammar having consumed
prefill's first token; the unconstrained ones take the tokens they take alone, which teacher forcing confirms."""
import json
import os

import pytest

from pdserve.engine.grammar import Grammars, GrammarSpec, fill
from pdserve.engine.sampler import SamplingParams, sample_one
from tests.unit.decode.test_scheduler_steps import PS, _admit, _check, _greedy, _prompt, _run, runner  # noqa: F401

SCHEMA = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"},
                                                      "level": {"type": "integer", "minimum": 1, "maximum": 9}},
                     "required": ["ok", "level"], "additionalProperties": False})


@pytest.fixture(scope="module")
def grammars(model_dir):
    return Grammars(os.path.join(model_dir, "tokenizer.json"), 512, [1])


def _constrained(runner, grammars, owner: int, prompt, page: int, sampling: SamplingParams):
    """A sequence whose first token prefill drew under the grammar (as worker._finish_chunk does)."""
    seq = _admit(runner, owner, prompt, page, sampling.max_tokens, sampling)
    state = grammars.start(sampling.grammar)
    n = -(-len(prompt) // PS)
    last = runner.prefill(prompt, seq.pages[:n])[-1]
    first = sample_one(last, sampling, 0, mask=fill([state], 512)[0])
    assert state.accept(first) is None
    seq.generated, seq.grammar = [first], state
    return seq


def test_constrained_and_unconstrained_rows_in_one_batch(runner, grammars, model_dir):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    prompts = [_prompt(19, 11), _prompt(33, 12)]
    alone = [toks for toks, err in _run(runner, [_admit(runner, 1 + i, p, 24 * i, 30, _greedy(30))
                                                 for i, p in enumerate(prompts)])]
    spec = GrammarSpec(SCHEMA)
    plain = [_admit(runner, 1 + i, p, 24 * i, 30, _greedy(30)) for i, p in enumerate(prompts)]
    constrained = [_constrained(runner, grammars, 5, _prompt(17, 13), 48, SamplingParams(max_tokens=60, grammar=spec)),
                   _constrained(runner, grammars, 6, _prompt(25, 14), 60,
                                SamplingParams(temperature=1.0, seed=5, max_tokens=60, grammar=spec))]
    results = _run(runner, [plain[0], constrained[0], plain[1], constrained[1]])
    for i in (0, 2):
        toks, err = results[i]
        assert err is None and toks == alone[i // 2]
        _check(runner, prompts[i // 2], toks, "unconstrained row beside constrained ones")
    for i in (1, 3):
        toks, err = results[i]
        value = json.loads(tok.decode(toks))
        assert err is None and len(toks) < 60 and set(value) == {"ok", "level"}
        assert isinstance(value["ok"], bool) and 1 <= value["level"] <= 9
        assert constrained[i // 2].is_stopped()  # ended by the grammar, not by max_tokens


class _Refusing:
    """A grammar state that refuses every token from now on (as one whose mask and matcher disagreed would)."""

    def __init__(self, state):
        self.matcher, self.is_done = state.matcher, False

    def accept(self, token):
        return f"token {token} refused for the test"


def test_a_token_the_grammar_refuses_ends_that_sequence_alone(runner, grammars):
    plain = _admit(runner, 1, _prompt(19, 21), 0, 8, _greedy(8))
    seq = _constrained(runner, grammars, 2, _prompt(21, 22), 24, SamplingParams(max_tokens=40,
                                                                               grammar=GrammarSpec(SCHEMA)))
    seq.grammar = _Refusing(seq.grammar)
    (ptoks, perr), (ctoks, cerr) = _run(runner, [plain, seq])
    assert perr is None and len(ptoks) == 8
    _check(runner, _prompt(19, 21), ptoks, "the other row of the step")
    assert cerr is not None and cerr.reason == "SAMPLING_FAILED" and "refused for the test" in cerr.message
    assert ctoks == seq.generated[:1]  # nothing past prefill's token was sent
