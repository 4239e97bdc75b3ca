"""Structured output's grammar (engine/grammar.py) on the tiny checkpoint's tokenizer: outputs drawn from random
logits under the mask parse against their schema every time and close within a bound; the cache is bounded;
what the library refuses is refused in its words; the bitmask means what it says."""
import json
import os
import random

import pytest
import torch

from pdserve.engine.closed_objects import MAX_NAMES
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


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}


def takes(grammars, tok, schema, text: str) -> bool:
    """Whether the grammar of schema takes text whole: every token, and nothing more needed."""
    state = grammars.start(GrammarSpec(json.dumps(schema)))
    return state.replay(tok.encode(text, add_special_tokens=False).ids) is None and state.matcher.is_accepting()


def test_an_object_refuses_properties_its_schema_does_not_declare(grammars, tok):
    assert takes(grammars, tok, CITY, '{"city":"Oslo"}')
    assert not takes(grammars, tok, CITY, '{"city":"Oslo","x":1}')
    assert not takes(grammars, tok, {**CITY, "required": []}, '{"x":1}')
    assert takes(grammars, tok, {**CITY, "additionalProperties": True}, '{"city":"Oslo","x":1}')
    typed = {**CITY, "additionalProperties": {"type": "integer"}}
    assert takes(grammars, tok, typed, '{"city":"Oslo","x":1}')
    assert not takes(grammars, tok, typed, '{"city":"Oslo","x":"a"}')
    # an object that declares no properties at all is any object, as json_object is
    assert takes(grammars, tok, {"type": "object"}, '{"x":1,"y":[2]}')


@pytest.mark.parametrize("where", ["properties", "items", "anyOf", "$defs", "recursive $defs"])
def test_nested_objects_are_closed_at_every_level(grammars, tok, where):
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    inner = {"type": "object", "properties": {"n": digit}, "required": ["n"]}
    schema, good, bad = {
        "properties": ({**CITY, "properties": {**CITY["properties"], "in": inner}, "required": ["city", "in"]},
                       '{"city":"Oslo","in":{"n":1}}', '{"city":"Oslo","in":{"n":1,"x":2}}'),
        "items": ({"type": "array", "items": inner}, '[{"n":1},{"n":2}]', '[{"n":1},{"n":2,"x":3}]'),
        "anyOf": ({"anyOf": [inner, CITY]}, '{"n":1}', '{"n":1,"x":2}'),
        "$defs": ({"$defs": {"In": inner}, "type": "array", "items": {"$ref": "#/$defs/In"}}, '[{"n":1}]',
                  '[{"n":1,"x":2}]'),
        "recursive $defs": ({"$defs": {"T": {"type": "object", "properties": {
            "n": digit, "kids": {"type": "array", "items": {"$ref": "#/$defs/T"}}}, "required": ["n"]}},
            "$ref": "#/$defs/T"}, '{"n":1,"kids":[{"n":2}]}', '{"n":1,"kids":[{"n":2,"x":3}]}'),
    }[where]
    assert takes(grammars, tok, schema, good) and not takes(grammars, tok, schema, bad)


@pytest.mark.parametrize("how", ["allOf", "allOf of a $ref", "$ref beside properties", "anyOf beside properties"])
def test_an_intersection_is_closed_as_a_whole_not_part_by_part(grammars, tok, how):
    """Closing each part would refuse what its sibling declares: {"a", "b"} is the object, "c" is not in it (the
    library orders an intersection's properties as it chooses: either order is the object)."""
    a, b = {"properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"properties": {"b": {"type": "integer"}}}
    schema = {"allOf": {"type": "object", "allOf": [a, b]},
              "allOf of a $ref": {"$defs": {"A": a}, "allOf": [{"$ref": "#/$defs/A"}, b]},
              "$ref beside properties": {"$defs": {"A": a}, "$ref": "#/$defs/A", **b},
              "anyOf beside properties": {**a, "anyOf": [b, {"required": ["a"]}]}}[how]
    assert any(takes(grammars, tok, schema, t) for t in ('{"a":1,"b":2}', '{"b":2,"a":1}'))
    assert takes(grammars, tok, schema, '{"a":1}')
    assert not any(takes(grammars, tok, schema, t) for t in ('{"a":1,"c":2}', '{"c":2,"a":1}'))
    assert not takes(grammars, tok, schema, '{"b":2}')  # a is required


def test_only_schemas_are_closed_not_values_that_look_like_them(grammars, tok):
    value = {"properties": {"x": 1}}
    assert takes(grammars, tok, {"const": value}, '{"properties":{"x":1}}')
    assert takes(grammars, tok, {"enum": [value]}, '{"properties":{"x":1}}')
    # a definition that is a part of an intersection and also used alone is closed where it is used alone
    a = {"type": "object", "properties": {"a": {"type": "integer"}}}
    both = {"$defs": {"A": a}, "type": "array", "prefixItems": [
        {"$ref": "#/$defs/A"}, {"allOf": [{"$ref": "#/$defs/A"}, {"properties": {"b": {}}}]}]}
    assert takes(grammars, tok, both, '[{"a":1},{"a":1,"b":2}]')
    assert not takes(grammars, tok, both, '[{"a":1,"b":2},{"a":1}]')


def test_random_logits_under_an_open_looking_schema_write_exactly_its_properties(grammars, tok):
    """The schema of a named tool call as clients send it, with no additionalProperties: whatever the logits
    prefer, the output is the declared object and closes."""
    spec = GrammarSpec(json.dumps(CITY))
    for seed in range(40):
        text = tok.decode(draw(grammars, spec, seed, limit=64))
        assert json.loads(text).keys() == {"city"} and json.loads(text)["city"] in ("Paris", "Oslo"), text


def test_intersections_that_would_gather_too_many_names_are_refused_with_the_bound(grammars, tok):
    """A chain of definitions, each an allOf of the next and one property of its own: closing each link gathers the
    names of every link after it, quadratic in the chain; past the bound the schema is refused, not worked on."""
    n = 400
    defs = {f"D{i}": {"allOf": [{"$ref": f"#/$defs/D{i + 1}"}], "properties": {f"p{i}": {}}} for i in range(n)}
    defs[f"D{n}"] = {"properties": {"z": {}}}
    with pytest.raises(GrammarError, match=f"more than {MAX_NAMES} property names"):
        grammars.start(GrammarSpec(json.dumps({"$defs": defs, "$ref": "#/$defs/D0"})))
    short = {"$defs": {f"D{i}": defs[f"D{i}"] for i in range(n - 20, n + 1)}, "$ref": f"#/$defs/D{n - 20}"}
    assert takes(grammars, tok, short, '{}') and not takes(grammars, tok, short, '{"x":1}')  # 20 links close
