"""Tool calls (gateway/openai/tools.py, tool_stream.py) on model outputs as the families' chat templates write
them: an assistant turn with tool calls rendered by a Qwen 2.5 template (Hermes <tool_call> blocks) and by a Llama
3.1 one (JSON), parsed back into the same calls; streamed in pieces cut anywhere, the deltas add up to exactly the
non-streamed message; forced calls come out of the grammar as calls to the tools offered."""
import json
import os
import random

import pytest
import torch

from pdserve.engine.chat import ChatTemplate
from pdserve.engine.grammar import Grammars, GrammarSpec, apply_mask, fill
from pdserve.gateway.openai.errors import ApiError
from pdserve.gateway.openai.schema import Message
from pdserve.gateway.openai.tool_stream import ToolStream
from pdserve.gateway.openai.tools import HERMES, LLAMA3_JSON, Call, ToolPlan, format_of, plan
from tests.unit.engine.chat_templates import QWEN25

# the assistant tool-call turn of Llama 3.1's template (one call per turn, arguments as an object)
LLAMA31 = """{{- bos_token }}
{%- for message in messages %}
    {%- if message.tool_calls is defined %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Nice"]}, "days": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 3}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_hour", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}}}
CALLS = [{"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Nice", "days": 2}'}},
         {"id": "call_2", "type": "function", "function": {"name": "get_hour", "arguments": '{"utc": true}'}}]


def rendered_output(template: str, calls: list[dict], content: str | None, after: str, end: str) -> str:
    """The text a model trained on this template writes for an assistant turn with these calls."""
    msg = Message.model_validate({"role": "assistant", "content": content, "tool_calls": calls}).to_template()
    text = ChatTemplate({"default": template}, {"bos_token": "<s>"}).render(
        [{"role": "user", "content": "hi"}, msg], add_generation_prompt=False)
    out = text[text.rindex(after) + len(after):]
    return out[:out.index(end)]


def as_objects(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


WANT = [("get_weather", {"city": "Nice", "days": 2}), ("get_hour", {"utc": True})]


def test_hermes_output_of_the_qwen_template_parses_back_into_its_calls():
    text = rendered_output(QWEN25, CALLS, "Let me check.", "<|im_start|>assistant\n", "<|im_end|>")
    assert text.startswith("Let me check.\n<tool_call>")
    content, calls = ToolPlan("auto", HERMES).parse(text)
    assert content == "Let me check." and as_objects(calls) == WANT
    content, calls = ToolPlan("auto", HERMES, parallel=False).parse(text)
    assert as_objects(calls) == WANT[:1]
    bare = rendered_output(QWEN25, CALLS, None, "<|im_start|>assistant", "<|im_end|>")
    assert ToolPlan("auto", HERMES).parse(bare)[0] is None


def test_llama3_json_output_of_the_llama_template_parses_back_into_its_call():
    text = rendered_output(LLAMA31, CALLS[:1], None, "<|start_header_id|>assistant<|end_header_id|>\n\n",
                           "<|eot_id|>")
    assert text.startswith('{"name": "get_weather", "parameters": {')
    content, calls = ToolPlan("auto", LLAMA3_JSON).parse(text)
    assert content is None and as_objects(calls) == WANT[:1]
    two = text + "; " + json.dumps({"name": "get_hour", "parameters": {"utc": True}})
    assert as_objects(ToolPlan("auto", LLAMA3_JSON).parse(two)[1]) == WANT


@pytest.mark.parametrize("text", ["Just words, no call.", '{"name": "x", "parameters": {"a": 1}} trailing words',
                                  "<tool_call>\n{not json}\n</tool_call>", '{"colour": "red"}', ""])
def test_text_that_is_no_call_stays_content_unchanged(text):
    for fmt in (HERMES, LLAMA3_JSON):
        assert ToolPlan("auto", fmt).parse(text) == (text, [])
    assert ToolPlan("none", HERMES).parse("<tool_call>{}</tool_call>") == ("<tool_call>{}</tool_call>", [])


def reassemble(stream: ToolStream, pieces: list[str]):
    content, calls, ids = "", {}, {}
    for d in [d for p in pieces for d in stream.push(p)] + stream.finish():
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if tc["index"] not in calls:
                assert tc["type"] == "function" and tc["id"].startswith("call_") and tc["function"]["arguments"] == ""
                calls[tc["index"]], ids[tc["index"]] = [tc["function"]["name"], ""], tc["id"]
            else:
                assert "id" not in tc and "name" not in tc["function"]
                calls[tc["index"]][1] += tc["function"]["arguments"]
    return content or None, [Call(*calls[i]) for i in sorted(calls)]


def cuts(text: str, seed: int) -> list[str]:
    r = random.Random(seed)
    points = sorted(r.sample(range(1, len(text)), min(len(text) - 1, r.randrange(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


HERMES_TEXT = rendered_output(QWEN25, CALLS, "  Let me check. ", "<|im_start|>assistant\n", "<|im_end|>")
LLAMA_TEXT = rendered_output(LLAMA31, CALLS[:1], None, "<|start_header_id|>assistant<|end_header_id|>\n\n",
                             "<|eot_id|>")


@pytest.mark.parametrize("tool_plan,text", [
    (ToolPlan("auto", HERMES), HERMES_TEXT), (ToolPlan("auto", HERMES, parallel=False), HERMES_TEXT),
    (ToolPlan("auto", HERMES), HERMES_TEXT + "<tool_call>\n{\"name\": \"get_hour\", \"arguments\": {}}"),
    (ToolPlan("auto", HERMES), "Plain text with a < and <tool and more \n"),
    (ToolPlan("auto", HERMES), "Before <tool_call>{broken</tool_call> after"),
    (ToolPlan("auto", LLAMA3_JSON), LLAMA_TEXT), (ToolPlan("auto", LLAMA3_JSON), "  plain {text}"),
    (ToolPlan("auto", LLAMA3_JSON), '{"not": "a call"}'),
    (ToolPlan("named", name="get_hour"), '{"utc":false}'),
    (ToolPlan("required"), '[{"name":"get_hour","parameters":{"utc":true}},{"name":"get_weather","parameters":'
                           '{"city":"Paris","days":3}}]'),
    (ToolPlan("required"), '[{"name":"get_hour","param'),  # cut by max_tokens: content, as non-streamed
    (ToolPlan("none"), "<tool_call>{}</tool_call>")])
def test_a_stream_cut_anywhere_adds_up_to_the_non_streamed_message(tool_plan, text):
    whole = tool_plan.parse(text)
    for seed in range(25):
        assert reassemble(ToolStream(tool_plan), cuts(text, seed)) == (whole[0] or None, whole[1]), seed


def test_hermes_calls_stream_as_soon_as_their_block_closes():
    s = ToolStream(ToolPlan("auto", HERMES))
    first_block_end = HERMES_TEXT.index("</tool_call>") + len("</tool_call>")
    deltas = s.push(HERMES_TEXT[:first_block_end])
    assert [d["content"] for d in deltas if "content" in d] == ["  Let me check."]
    assert [d["tool_calls"][0]["function"].get("name") for d in deltas if "tool_calls" in d] == ["get_weather", None]


def test_the_tool_call_format_follows_the_template():
    assert format_of(ChatTemplate({"default": QWEN25}, {})) == HERMES
    assert format_of(ChatTemplate({"default": LLAMA31}, {})) == LLAMA3_JSON and format_of(None) == LLAMA3_JSON


def test_plan_modes_and_refusals():
    tools = [WEATHER, CLOCK]
    assert plan(tools, None, True, HERMES, False).mode == "auto"
    assert plan(None, None, True, HERMES, False).mode == "none"
    none = plan(tools, "none", True, HERMES, False)
    assert none.render is None and not none.parses  # no tools rendered, nothing parsed
    named = plan(tools, {"type": "function", "function": {"name": "get_hour"}}, True, HERMES, False)
    assert named.schema == CLOCK["function"]["parameters"] and named.render == tools
    one = plan(tools, "required", False, HERMES, False).schema
    assert one["maxItems"] == 1 and one["minItems"] == 1 and len(one["items"]["anyOf"]) == 2
    for bad, words in [((tools, {"type": "function", "function": {"name": "nope"}}), "names function 'nope'"),
                       ((None, "required"), "needs tools"), ((tools + [CLOCK], "auto"), "name a function twice")]:
        with pytest.raises(ApiError, match=words):
            plan(*bad, True, HERMES, False)
    with pytest.raises(ApiError, match="response_format"):
        plan(tools, "required", True, HERMES, True)


@pytest.fixture(scope="module")
def grammars(model_dir):
    return Grammars(os.path.join(model_dir, "tokenizer.json"), 512, [1])


@pytest.fixture(scope="module")
def tok(model_dir):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))


def forced_calls(grammars, tok, p: ToolPlan, seed: int, limit: int) -> tuple[str | None, list[Call]]:
    """What p parses out of an output drawn from random logits under its forced call's grammar, closed within
    limit tokens."""
    g, state, ids = torch.Generator().manual_seed(seed), grammars.start(GrammarSpec(json.dumps(p.schema))), []
    while not state.is_done:
        x = torch.randn(1, 512, generator=g) * 4
        apply_mask(x, fill([state], 512))
        ids.append(int(torch.multinomial(torch.softmax(x[0], -1), 1, generator=g)))
        assert state.accept(ids[-1]) is None and len(ids) < limit
    return p.parse(tok.decode(ids))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_from_random_logits_are_calls_to_the_tools_offered(grammars, tok, choice):
    p = plan([WEATHER, CLOCK], choice, False, HERMES, False)
    for seed in range(15):
        content, calls = forced_calls(grammars, tok, p, seed, 150)
        assert content is None and len(calls) == 1
        args = json.loads(calls[0].arguments)
        if calls[0].name == "get_weather":
            assert args["city"] in ("Paris", "Nice") and 1 <= args["days"] <= 3 and len(args) == 2
        else:
            assert calls[0].name == "get_hour" and isinstance(args["utc"], bool) and choice == "required"


def test_forced_arguments_hold_exactly_the_declared_properties(grammars, tok):
    """Tools as clients usually send them, without additionalProperties: a forced call's arguments are the declared
    properties and nothing else, and a function that declares no parameters is called with {}."""
    city = {"type": "function", "function": {"name": "city", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}
    ping = {"type": "function", "function": {"name": "ping"}}
    for choice in [{"type": "function", "function": {"name": name}} for name in ("city", "ping")] + ["required"]:
        p = plan([city, ping], choice, False, HERMES, False)
        for seed in range(10):
            (call,) = forced_calls(grammars, tok, p, seed, 64)[1]
            args = json.loads(call.arguments)
            want = {} if call.name == "ping" else {"city": args.get("city")}
            assert args == want and want.get("city", "Oslo") in ("Paris", "Oslo")
