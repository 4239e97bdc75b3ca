"""Structured output's grammar (engine/grammar.py) on the tiny checkpoint's tokenizer: outputs drawn from random
logits under the mask parse against their schema every time and close within a bound; the cache is bounded;
what the library refuses is refused in its words; the bitmask means what it says."""
import json
import os
import random

import pytest
import torch

from pdserve.engine.grammar import GrammarError, Grammars, GrammarSpec, allowed, apply_mask, fill

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 20},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["ok", "colour", "count", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def grammars(model_dir):
    return Grammars(os.path.join(model_dir, "tokenizer.json"), 512, [1])


@pytest.fixture(scope="module")
def tok(model_dir):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))


def _valid(v) -> bool:
    return (isinstance(v, dict) and set(v) == {"ok", "colour", "count", "tags"} and isinstance(v["ok"], bool)
            and v["colour"] in ("red", "green", "blue") and type(v["count"]) is int and 0 <= v["count"] <= 20
            and len(v["tags"]) <= 2 and set(v["tags"]) <= {"a", "b"})


def draw(grammars, spec, seed: int, limit: int = 200) -> list[int]:
    """Tokens drawn from random logits under the grammar's mask, until it is done (or limit)."""
    g = torch.Generator().manual_seed(seed)
    state, out = grammars.start(spec), []
    while not state.is_done and len(out) < limit:
        x = torch.randn(1, 512, generator=g) * 4
        apply_mask(x, fill([state], 512))
        t = int(torch.multinomial(torch.softmax(x[0], -1), 1, generator=g))
        assert state.accept(t) is None
        out.append(t)
    return out


def test_random_logits_under_a_finite_schema_always_parse_and_close(grammars, tok):
    spec = GrammarSpec(json.dumps(SCHEMA))
    lengths = []
    for seed in range(40):
        ids = draw(grammars, spec, seed)
        text = tok.decode(ids)
        assert _valid(json.loads(text)), text
        lengths.append(len(ids))
    assert max(lengths) < 120  # compact JSON of a finite language: bounded, far below a typical max_tokens


def test_json_object_takes_any_object_and_nothing_else(grammars, tok):
    spec = GrammarSpec(json_object=True)
    obj = tok.encode('{"a":[1,2,{"b":null}],"c":"x"}', add_special_tokens=False).ids
    state = grammars.start(spec)
    assert state.replay(obj) is None and state.is_done
    arr = tok.encode("[1]", add_special_tokens=False).ids
    assert "breaks the grammar" in grammars.start(spec).replay(arr)
    m = allowed(fill([grammars.start(spec)], 512), 512)[0]
    assert m[tok.token_to_id("{")] and not m[tok.token_to_id("[")]


def test_the_library_words_for_a_schema_it_cannot_compile(grammars):
    with pytest.raises(GrammarError, match="unclosed group"):
        grammars.start(GrammarSpec('{"type": "string", "pattern": "(("}'))
    with pytest.raises(GrammarError, match="foo"):
        grammars.start(GrammarSpec('{"type": "foo"}'))
    with pytest.raises(GrammarError, match="not a JSON schema"):
        grammars.start(GrammarSpec("{nope"))


def test_compiled_grammars_are_cached_by_schema_and_bounded(model_dir):
    g = Grammars(os.path.join(model_dir, "tokenizer.json"), 512, [1], max_entries=2)
    specs = [GrammarSpec(json.dumps({"enum": [f"v{i}"]})) for i in range(3)]
    first = g.compile(specs[0])
    assert g.compile(specs[0]) is first  # a hit
    g.compile(specs[1])
    g.compile(specs[2])
    assert len(g._cache) == 2 and specs[0] not in g._cache  # least recently used went first
    a, b = g.start(specs[1]), g.start(specs[1])
    assert a.matcher is not b.matcher  # each request its own state


def test_no_tokenizer_json_refuses_structured_output():
    with pytest.raises(GrammarError, match="tokenizer.json"):
        Grammars(None, 512, [1]).start(GrammarSpec(json_object=True))


def test_bitmask_unpacks_to_the_tokens_it_names():
    r = random.Random(3)
    want = torch.tensor([[r.random() < 0.3 for _ in range(70)] for _ in range(3)])
    words = torch.zeros(3, 3, dtype=torch.int64)
    for i, j in want.nonzero().tolist():
        words[i, j // 32] |= 1 << (j % 32)
    mask = words.to(torch.int64).apply_(lambda w: w - (1 << 32) if w >= 1 << 31 else w).to(torch.int32)
    assert torch.equal(allowed(mask, 70), want)
    x = torch.zeros(3, 70)
    apply_mask(x, mask)
    assert torch.equal(x == 0, want) and bool((x[~want] == float("-inf")).all())
