"""Admission of the sampling options: each bad value is INVALID_ARGUMENT with its reason and numbers."""
import asyncio
import math
import os

import grpc
import pytest

from pdserve.common.admission import MAX_STOP_CHARS, check_grammar, check_options, check_stop_strings, start_grammar
from pdserve.common.errors import PdError
from pdserve.engine.grammar import MAX_SCHEMA_BYTES, Grammars, GrammarSpec
from pdserve.engine.sampler import SamplingParams
from tests.unit.common.test_admission import _rejected

VOCAB = 512


@pytest.mark.parametrize("field,value,reason,numbers", [
    ("top_k", VOCAB + 1, "BAD_TOP_K", [VOCAB + 1, VOCAB]),
    ("frequency_penalty", 2.5, "BAD_PENALTY", [2.5, "frequency_penalty"]),
    ("presence_penalty", -2.01, "BAD_PENALTY", [-2.01, "presence_penalty"]),
    ("presence_penalty", math.nan, "BAD_PENALTY", ["nan"]),
    ("repetition_penalty", 0.0, "BAD_PENALTY", [0.0]),
    ("repetition_penalty", -1.0, "BAD_PENALTY", [-1.0]),
    ("repetition_penalty", math.inf, "BAD_PENALTY", ["inf"]),
    ("stop_token_ids", (3, VOCAB), "BAD_STOP", [VOCAB]),
    ("stop_token_ids", (-1,), "BAD_STOP", [-1]),
    ("stop_token_ids", tuple(range(65)), "BAD_STOP", [65, 64]),
    ("logprobs", 21, "BAD_LOGPROBS", [21, 20]),
])
def test_bad_option_is_refused_with_its_numbers(field, value, reason, numbers):
    _rejected(check_options, SamplingParams(**{field: value}), VOCAB, reason=reason, numbers=numbers)


def test_bad_prompt_logprobs_is_refused():
    _rejected(check_options, SamplingParams(), VOCAB, 25, reason="BAD_LOGPROBS", numbers=[25, "prompt_logprobs"])


def test_edges_are_admitted():
    check_options(SamplingParams(top_k=VOCAB, frequency_penalty=-2.0, presence_penalty=2.0, repetition_penalty=1e-3,
                                 stop_token_ids=(0, VOCAB - 1), logprobs=20), VOCAB, 0)
    check_stop_strings(["a", "x" * MAX_STOP_CHARS, "\n\n", "END"])


@pytest.mark.parametrize("stop,numbers", [(["a"] * 5, [5, 4]), (["ok", ""], [1, 0]),
                                           (["x" * (MAX_STOP_CHARS + 1)], [MAX_STOP_CHARS + 1, MAX_STOP_CHARS])])
def test_bad_stop_strings_are_refused(stop, numbers):
    _rejected(check_stop_strings, stop, reason="BAD_STOP", numbers=numbers)


@pytest.mark.parametrize("fields,reason,numbers", [
    ({"logit_bias": ((VOCAB, 1.0),)}, "BAD_LOGIT_BIAS", [VOCAB]),
    ({"logit_bias": ((3, 100.5),)}, "BAD_LOGIT_BIAS", [100.5, 3]),
    ({"logit_bias": ((3, math.nan),)}, "BAD_LOGIT_BIAS", ["nan"]),
    ({"logit_bias": tuple((i, 0.0) for i in range(1025))}, "BAD_LOGIT_BIAS", [1025, 1024]),
    ({"min_p": 1.5}, "BAD_MIN_P", [1.5]),
    ({"min_tokens": 17, "max_tokens": 16}, "BAD_MIN_TOKENS", [17, 16]),
    ({"grammar": GrammarSpec("{}", json_object=True)}, "BAD_GRAMMAR", ["json_object"]),
    ({"grammar": GrammarSpec("x" * (MAX_SCHEMA_BYTES + 1))}, "BAD_GRAMMAR", [MAX_SCHEMA_BYTES + 1]),
])
def test_bad_agent_option_is_refused_with_its_numbers(fields, reason, numbers):
    _rejected(check_options, SamplingParams(**fields), VOCAB, reason=reason, numbers=numbers)


def test_agent_option_edges_are_admitted():
    check_options(SamplingParams(logit_bias=((0, -100.0), (VOCAB - 1, 100.0)), min_p=1.0, min_tokens=16,
                                 max_tokens=16, grammar=GrammarSpec(json_object=True)), VOCAB)


def test_a_grammar_refused_by_the_library_or_the_instance():
    _rejected(check_grammar, None, GrammarSpec(json_object=True), reason="BAD_GRAMMAR", numbers=["not available"])


def test_tokens_generated_before_that_break_the_grammar_end_the_request(model_dir):
    from tokenizers import Tokenizer
    path = os.path.join(model_dir, "tokenizer.json")
    grammars, tok = Grammars(path, VOCAB, [1]), Tokenizer.from_file(path)
    brace, bracket = tok.token_to_id("{"), tok.token_to_id("[")
    with pytest.raises(PdError) as e:  # "[" cannot follow "{": prefill and decode disagree
        asyncio.run(start_grammar(grammars, GrammarSpec(json_object=True), [brace, bracket]))
    assert e.value.code == grpc.StatusCode.INTERNAL and e.value.reason == "GRAMMAR_MISMATCH"
    assert "generated token 1" in e.value.message
    state = asyncio.run(start_grammar(grammars, GrammarSpec(json_object=True), [brace]))
    assert not state.is_done
