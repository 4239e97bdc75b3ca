"""Issue 21, point 3 (agents) through the whole stack with the official client: structured output enforced while
sampling (chat.completions.parse on a pydantic model, every try), forced tool calls (required, named) with a tool
loop, streamed tool calls that add up to the non-streamed ones, logit_bias, min_p, min_tokens, and a constrained
request beside an unconstrained one that still passes the oracle. The random model cannot choose tools or write
JSON by itself: every schema here has a finite language (enums, booleans, bounded integers), so the grammar closes
the JSON long before max_tokens."""
import json
import threading
from typing import Literal

import openai
import pytest
import torch
from pydantic import BaseModel, Field

from pdserve.engine.chat import ChatTemplate
from pdserve.engine.tokenizer import load_tokenizer
from tests.integration.drain_util import openai_gateway
from tests.integration.helpers import prompt, with_template
from tests.unit.engine.chat_templates import QWEN25

KEY = "sk-test-agents"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Nice", "Lyon"]},
                                                    "celsius": {"type": "boolean"}},
                   "required": ["city", "celsius"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_hour", "parameters": {"type": "object", "properties": {"offset": {"type": "integer", "minimum": -3,
                                                                                  "maximum": 3}},
                                       "required": ["offset"], "additionalProperties": False}}}
CHAT = [{"role": "user", "content": "What is the weather in Nice?"}]


class Verdict(BaseModel):
    ok: bool
    colour: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=20)


@pytest.fixture(scope="module")
def hermes_dir(model_dir, tmp_path_factory):
    """The tiny checkpoint with a Qwen 2.5 style template: tool calls in <tool_call> blocks."""
    return with_template(model_dir, tmp_path_factory.mktemp("hermes-model"), QWEN25)


@pytest.fixture(scope="module")
def client(stack, hermes_dir):
    with openai_gateway(stack, hermes_dir, KEY) as gw:
        yield gw.client


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_parse_returns_a_valid_pydantic_object_every_try(client, model):
    seen = set()
    for seed in range(24):
        out = client.chat.completions.parse(model=model, messages=CHAT, response_format=Verdict, max_tokens=64,
                                            temperature=1.0, seed=seed)
        (choice,) = out.choices
        assert choice.finish_reason == "stop", choice
        v = choice.message.parsed
        assert isinstance(v, Verdict) and Verdict.model_validate_json(choice.message.content) == v
        seen.add(v.model_dump_json())
    assert len(seen) > 1  # sampled, not one canned answer


def test_json_schema_over_grpc_and_a_schema_the_library_refuses(stack):
    schema = json.dumps(Verdict.model_json_schema())
    r = stack.generate(prompt_token_ids=prompt(12, 5), max_tokens=64, temperature=0.7, seed=3, json_schema=schema)
    assert r["finish_reason"] == "stop"
    Verdict.model_validate_json(r["text"])
    err = stack.generate(prompt_token_ids=prompt(12, 5), max_tokens=8,
                         json_schema='{"type": "string", "pattern": "(("}')["error"]
    assert err["code"] == "INVALID_ARGUMENT" and err["reason"] == "BAD_GRAMMAR" and "unclosed group" in err["message"]


def test_json_object_is_enforced_from_the_first_token(client, model, hermes_dir):
    """"}" pushed up by logit_bias cannot come first (the grammar forbids it): prefill's token is "{", decode's grammar
    takes it and then lets "}" close the object."""
    close = load_tokenizer(hermes_dir, 512).encode("}")
    assert len(close) == 1
    out = client.chat.completions.create(model=model, messages=CHAT, max_tokens=32, temperature=0,
                                         response_format={"type": "json_object"}, logit_bias={str(close[0]): 100})
    (choice,) = out.choices
    assert choice.message.content == "{}" and choice.finish_reason == "stop" and out.usage.completion_tokens == 2
    free = client.chat.completions.create(model=model, messages=CHAT, max_tokens=2, temperature=0,
                                          logit_bias={str(close[0]): 100}, extra_body={"ignore_eos": True})
    assert free.choices[0].message.content == "}}"  # the same bias without the grammar


def test_http_refuses_an_uncompilable_schema_with_the_library_words(client, model):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(("}}, "required": ["a"]}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=CHAT, response_format=bad, max_tokens=8)
    assert "unclosed group" in e.value.message


def _forced(client, model, **kw):
    return client.chat.completions.create(model=model, messages=CHAT, tools=[WEATHER, CLOCK], max_tokens=96,
                                          temperature=0, **kw)


def test_tool_loop_with_forced_calls(client, model):
    out = _forced(client, model, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert args["city"] in ("Paris", "Nice", "Lyon") and isinstance(args["celsius"], bool)
    # the loop goes on: the call and its result are rendered back into the conversation, and the model answers
    follow = [*CHAT, choice.message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 degrees"}]
    again = client.chat.completions.create(model=model, messages=follow, tools=[WEATHER], tool_choice="none",
                                           max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].message.tool_calls is None and again.choices[0].message.content
    assert again.usage.prompt_tokens > out.usage.prompt_tokens + len("sunny, 24 degrees")

    req = _forced(client, model, tool_choice="required", parallel_tool_calls=False)
    (call,) = req.choices[0].message.tool_calls  # parallel_tool_calls false: exactly one
    assert call.function.name in ("get_weather", "get_hour")
    args = json.loads(call.function.arguments)
    assert args.keys() == ({"city", "celsius"} if call.function.name == "get_weather" else {"offset"})


def _reassemble(chunks) -> tuple[list[tuple[str, str]], str | None]:
    calls: dict[int, list] = {}
    finish = None
    for c in chunks:
        for ch in c.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                if d.index not in calls:  # the first delta of a call: id, type and name, arguments ""
                    assert d.id and d.type == "function" and d.function.name and d.function.arguments == ""
                    calls[d.index] = [d.function.name, ""]
                else:
                    assert d.id is None and not d.function.name
                    calls[d.index][1] += d.function.arguments
    return [tuple(calls[i]) for i in sorted(calls)], finish


# required with parallel calls has no bound on the array's length, which a random model may not close in time
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_hour"}}])
def test_streamed_tool_calls_add_up_to_the_non_streamed_ones(client, model, choice):
    whole = _forced(client, model, tool_choice=choice, parallel_tool_calls=False)
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    streamed, finish = _reassemble(_forced(client, model, tool_choice=choice, parallel_tool_calls=False,
                                           stream=True))
    assert streamed == expected and finish == whole.choices[0].finish_reason == "tool_calls"


def test_chat_template_kwargs_add_generation_prompt_is_honoured(client, model, hermes_dir):
    template, tok = ChatTemplate.from_dir(hermes_dir), load_tokenizer(hermes_dir, 512)
    kw = {"model": model, "messages": CHAT, "max_tokens": 1}
    on = client.chat.completions.create(**kw)
    off = client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert on.usage.prompt_tokens == len(tok.encode(template.render(CHAT, True)))
    assert off.usage.prompt_tokens == len(tok.encode(template.render(CHAT, False))) < on.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"messages": []}})
    assert "chat_template_kwargs may not set messages" in e.value.message


def _greedy(client, model, p, n, **kw):
    extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
    return client.completions.create(model=model, prompt=p, max_tokens=n, temperature=0, extra_body=extra,
                                     **kw).choices[0]


def test_logit_bias_min_tokens_and_min_p_change_tokens_as_the_logits_say(client, model, oracle):
    p = prompt(16, 77)
    plain = _greedy(client, model, p, 4).token_ids
    oracle.check(p, plain)
    first = oracle.hf_logits(p)[-1]
    second = int(torch.topk(first, 2).indices[1])
    assert _greedy(client, model, p, 1, logit_bias={str(plain[0]): -100}).token_ids == [second]
    assert _greedy(client, model, p, 3, logit_bias={"300": 100}).token_ids == [300] * 3
    # the greedy first token as a stop token ends the output at once, unless min_tokens holds it back
    stopped = _greedy(client, model, p, 3, extra_body={"stop_token_ids": [plain[0]]})
    assert stopped.token_ids == [plain[0]] and stopped.text == "" and stopped.finish_reason == "stop"
    held = _greedy(client, model, p, 1, extra_body={"stop_token_ids": [plain[0]], "min_tokens": 1})
    assert held.token_ids == [second]
    # min_p 1 keeps only the most likely token: sampling at temperature 1 gives the greedy tokens
    sampled = client.completions.create(model=model, prompt=p, max_tokens=4, temperature=1.0, seed=9,
                                        extra_body={"ignore_eos": True, "min_p": 1.0}).choices[0]
    assert sampled.token_ids == plain


def test_unconstrained_rows_beside_constrained_ones_are_unchanged(client, model, oracle, stack):
    p = prompt(24, 31)
    alone = stack.generate(prompt_token_ids=p, max_tokens=40, ignore_eos=True)["token_ids"]
    results, errors = {}, []

    def constrained(i):
        try:
            results[i] = client.chat.completions.parse(model=model, messages=CHAT, response_format=Verdict,
                                                       max_tokens=64, temperature=1.0, seed=100 + i)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=constrained, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    beside = stack.generate(prompt_token_ids=p, max_tokens=40, ignore_eos=True)["token_ids"]
    for t in threads:
        t.join()
    assert not errors and all(isinstance(r.choices[0].message.parsed, Verdict) for r in results.values())
    assert beside == alone
    oracle.check(p, beside)
