"""Tool arguments and structured output held to their schema through the whole stack, with the official client and
over gRPC: a schema as clients usually write it (no additionalProperties) names one property, an enum, and the
output is exactly that object, closed long before max_tokens, on every seed. JSON Schema's default would let the
random model invent keys until max_tokens; `strict` (absent, true, false) changes nothing, as the README says."""
import json

import pytest

from tests.integration.drain_util import openai_gateway
from tests.integration.helpers import prompt, with_template
from tests.unit.engine.chat_templates import QWEN25

KEY = "sk-test-schema"
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}
CHAT = [{"role": "user", "content": "What is the weather in Oslo?"}]
SEEDS = range(5)
STRICT = [None, True, False]


@pytest.fixture(scope="module")
def client(stack, model_dir, tmp_path_factory):
    with openai_gateway(stack, with_template(model_dir, tmp_path_factory.mktemp("schema-model"), QWEN25), KEY) as gw:
        yield gw.client


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _held(text: str) -> dict:
    value = json.loads(text)
    assert value.keys() == {"city"} and value["city"] in ("Paris", "Oslo"), text
    return value


def test_a_named_tool_call_holds_exactly_its_parameters(client, model):
    for seed in SEEDS:
        strict = STRICT[seed % len(STRICT)]
        tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                 "parameters": CITY, **({} if strict is None else {"strict": strict})}}
        out = client.chat.completions.create(model=model, messages=CHAT, tools=[tool], max_tokens=64,
                                             tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                             temperature=0.8, seed=seed)
        (choice,) = out.choices
        (call,) = choice.message.tool_calls
        print(f"seed {seed} strict {strict}: {call.function.arguments} in {out.usage.completion_tokens} tokens")
        assert call.function.name == "get_weather" and choice.finish_reason == "tool_calls"
        _held(call.function.arguments)
        assert out.usage.completion_tokens < 64


def test_response_format_json_schema_holds_exactly_its_schema(client, model):
    for seed in SEEDS:
        strict = STRICT[seed % len(STRICT)]
        fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY,
                                                      **({} if strict is None else {"strict": strict})}}
        out = client.chat.completions.create(model=model, messages=CHAT, response_format=fmt, max_tokens=64,
                                             temperature=0.8, seed=seed)
        (choice,) = out.choices
        print(f"seed {seed} strict {strict}: {choice.message.content} in {out.usage.completion_tokens} tokens")
        assert choice.finish_reason == "stop"
        _held(choice.message.content)


def test_grpc_json_schema_is_held_by_the_same_rule(stack):
    for seed in SEEDS:
        r = stack.generate(prompt_token_ids=prompt(12, 7), max_tokens=64, temperature=0.8, seed=seed,
                           json_schema=json.dumps(CITY))
        print(f"seed {seed}: {r}")
        assert r.get("finish_reason") == "stop" and len(r["token_ids"]) < 64, r
        _held(r["text"])
