"""The OpenAI front when the gateway itself fails, or a body is built to make it fail: a stream broken by any
exception ends with an error event (OpenAI's shape, the request id) and `data: [DONE]`; a 500 carries the request id
and a generic message while the exception goes to the log under that id; JSON nested past MAX_JSON_DEPTH is a 400
found on the bytes, before any parser recurses; the default body limit admits the largest legal request. In-process,
through httpx's ASGI transport, over the real GatewayServicer with stub backends whose decode stream fails with a
non-PdError (as test_resubmit.py's)."""
import asyncio
import json
import logging
import random
import time
from types import SimpleNamespace

import grpc
import httpx
import pytest

from pdserve.common.errors import PdError
from pdserve.common.proto import common_pb2, decode_pb2, prefill_pb2
from pdserve.engine.chat import ChatTemplate
from pdserve.engine.tokenizer import ByteTokenizer
from pdserve.gateway.openai.app import Front, create_app
from pdserve.gateway.openai.body import MAX_JSON_DEPTH, json_depth, parse
from pdserve.gateway.openai.completions import MAX_CHOICES
from pdserve.gateway.openai.errors import ApiError
from pdserve.gateway.openai.schema import CompletionRequest
from pdserve.gateway.openai.server import Limits, largest_request_bytes
from pdserve.gateway.openai.stream import event_stream
from pdserve.gateway.openai.tools import HERMES, LLAMA3_JSON, ToolPlan
from pdserve.gateway.router import Backend, Router
from pdserve.gateway.servicer import Capacity, GatewayServicer

SECRET = "decode stub: /srv/pdserve/secret.key 0xdeadbeef"  # what the client must never read
RID = "req-broken-0001"
TOKENS = [65, 66, 67]  # "ABC" in the byte tokenizer


class BrokenRun:
    """Decode's Run stream: the destination, TOKENS, then a failure that is not a PdError (a bug, or a library's
    own exception type), with no finish."""

    def __init__(self):
        self.events = [decode_pb2.RunEvent(destination=common_pb2.Destination(pool_id="p"))]
        self.events += [decode_pb2.RunEvent(token=decode_pb2.DecodeResponse(token_id=t)) for t in TOKENS]

    async def read(self):
        if self.events:
            return self.events.pop(0)
        raise RuntimeError(SECRET)

    def cancel(self):
        pass


class Decode:
    def Run(self, req, timeout):
        return BrokenRun()


class Prefill:
    async def Prefill(self, req, timeout):
        return prefill_pb2.PrefillResponse()


def front(limits: Limits = Limits(), template: ChatTemplate | None = None) -> Front:
    info = SimpleNamespace(free_pages=100, queue_depth=0)
    gw = GatewayServicer(Router("prefill", [Backend("pf", Prefill(), info)]),
                         Router("decode", [Backend("dc", Decode(), info)]), ByteTokenizer(512),
                         Capacity("m", 4096, 512, 16, 100, 4096))
    return Front(gw, ["m"], limits, template)


def post(f: Front, path: str, body: dict | bytes) -> httpx.Response:
    async def main():
        # raise_app_exceptions=False: the client sees what uvicorn would send, not the exception Starlette re-raises
        transport = httpx.ASGITransport(app=create_app(f, None), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            return await c.post(path, content=content, headers={"X-Request-Id": RID,
                                                                "Content-Type": "application/json"})
    return asyncio.run(main())


def events(r: httpx.Response) -> list:
    lines = [line[len("data: "):] for line in r.text.split("\n\n") if line]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def the_internal_error(err: dict) -> None:
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "server_error" and err["code"] == "internal_error" and err["param"] is None
    assert RID in err["message"] and SECRET not in err["message"] and "RuntimeError" not in err["message"], err


def logged_under_the_request_id(caplog) -> None:
    records = [r for r in caplog.records if r.exc_info and SECRET in str(r.exc_info[1])]
    assert records and all(RID in r.getMessage() for r in records), [r.getMessage() for r in caplog.records]


def test_a_stream_broken_by_an_internal_error_ends_with_an_error_event_and_done(caplog):
    caplog.set_level(logging.INFO)
    r = post(front(), "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 8, "ignore_eos": True, "stream": True})
    assert r.status_code == 200 and r.headers["x-request-id"] == RID
    got = events(r)
    assert got[-1] == "[DONE]" and "error" in got[-2], got
    texts = "".join(c["choices"][0]["text"] for c in got[:-2])
    assert texts == bytes(TOKENS).decode()  # every token before the failure reached the client, in order
    the_internal_error(got[-2]["error"])
    assert SECRET not in r.text
    logged_under_the_request_id(caplog)


def test_a_failure_in_the_gateway_s_own_formatting_ends_the_stream_too(caplog):
    """chunks() is the route's own code (tool-call deltas, logprobs): an exception there is no PdError either."""
    caplog.set_level(logging.INFO)

    async def gen():
        yield 0, "second"

    def chunks(i, r):
        if r == "second":
            raise KeyError(SECRET)
        yield {"n": r}

    async def main():
        resp = event_stream(gen(), (0, "first"), chunks, lambda: iter(()), RID)
        return [part async for part in resp.body_iterator]
    got = [p.decode() for p in asyncio.run(main())]
    assert got[0] == 'data: {"n": "first"}\n\n' and got[-1] == "data: [DONE]\n\n" and len(got) == 3, got
    the_internal_error(json.loads(got[1][len("data: "):])["error"])
    logged_under_the_request_id(caplog)


def test_a_pd_error_in_a_stream_is_still_its_own_error():
    async def gen():
        raise PdError(grpc.StatusCode.UNAVAILABLE, "NO_BACKEND", "no decode takes work (3 known)")
        yield

    async def main():
        resp = event_stream(gen(), (0, "first"), lambda i, r: [{"n": r}], lambda: iter(()), RID)
        return [part async for part in resp.body_iterator]
    got = [p.decode() for p in asyncio.run(main())]
    err = json.loads(got[1][len("data: "):])["error"]
    assert err["code"] == "no_backend" and "3 known" in err["message"] and got[-1] == "data: [DONE]\n\n"


def test_a_500_carries_the_request_id_and_not_the_exception(caplog):
    caplog.set_level(logging.INFO)
    r = post(front(), "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 8, "ignore_eos": True})
    assert r.status_code == 500 and r.headers["x-request-id"] == RID and r.headers["x-should-retry"] == "false"
    the_internal_error(r.json()["error"])
    assert SECRET not in r.text
    logged_under_the_request_id(caplog)


def reference_depth(v) -> int:
    """Depth by walking the parsed value: the independent path json_depth must agree with."""
    if isinstance(v, dict):
        return 1 + max(map(reference_depth, v.values()), default=0)
    if isinstance(v, list):
        return 1 + max(map(reference_depth, v), default=0)
    return 0


def random_value(rng: random.Random, depth: int):
    """Nested arrays and objects down to `depth`, with strings full of what could fool a byte scanner."""
    if depth == 0:
        return rng.choice(["[[{", '"}]\\', "\\\\", "a\\\"[", "\u00b2[\u0663", 7, None, True, -1.5e3, ""])
    # one child carries the depth, its siblings stay shallow (the size stays linear in the depth)
    kids = [random_value(rng, rng.randrange(min(depth, 3)) if i else depth - 1) for i in range(rng.randint(1, 3))]
    if rng.random() < 0.5:
        return kids
    return {rng.choice(["k", "[", '"{', "\\"]) + str(i): k for i, k in enumerate(kids)}


def test_json_depth_agrees_with_the_parsed_value():
    rng = random.Random(27)
    for n in range(300):
        value = random_value(rng, rng.randrange(0, 40))
        for raw in (json.dumps(value), json.dumps(value, ensure_ascii=False, separators=(",", ":"))):
            assert json_depth(raw.encode()) == reference_depth(value), raw


@pytest.mark.parametrize("raw, depth", [
    (b"[" * 100_000, 100_000),
    (b"[" * 100_000 + b"]" * 100_000, 100_000),
    (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, 50_000),
    (b'{"a": "' + b"[" * 100_000, 1),  # inside an unterminated string: no parser recurses into it
    (b'{"a": "\\"' + b"[" * 100_000 + b'"}', 1),  # an escaped quote does not end the string
    (b'{"a": "\\\\"' + b", " + b"[" * 300, 301),  # an escaped backslash does not escape the quote
    (b"]]]]" + b"[" * 3, 0),  # a parser stops at the first "]"
    (b"[[]]]]" + b"[" * 3, 2),
])
def test_json_depth_of_hostile_bytes(raw, depth):
    assert json_depth(raw) == depth


def nested_schema(levels: int) -> dict:
    """A JSON schema whose object nests `levels` objects deep (two JSON levels each: properties, then the field)."""
    s = {"type": "integer"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"x": s}}
    return s


def body_of_depth(depth: int) -> bytes:
    """A completion body `depth` (even) levels deep: body, response_format, json_schema, the schema (4 levels),
    then two more per nested object."""
    schema = nested_schema((depth - 4) // 2)
    raw = json.dumps({"prompt": [5], "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}).encode()
    assert json_depth(raw) == reference_depth(json.loads(raw)) == depth
    return raw


def test_a_body_at_the_depth_limit_parses_and_one_past_it_is_refused_before_parsing():
    ok = body_of_depth(MAX_JSON_DEPTH)
    assert parse(ok, CompletionRequest).response_format.json_schema.schema_ == json.loads(ok)["response_format"][
        "json_schema"]["schema"]
    with pytest.raises(ApiError) as e:
        parse(body_of_depth(MAX_JSON_DEPTH + 2), CompletionRequest)
    assert e.value.status == 400 and e.value.code == "json_too_deep"
    assert e.value.message == f"the body nests arrays and objects {MAX_JSON_DEPTH + 2} levels deep; the limit is " \
                              f"{MAX_JSON_DEPTH}"
    deep = b'{"prompt": ' + b"[" * 100_000 + b"5" + b"]" * 100_000 + b"}"
    start = time.perf_counter()
    with pytest.raises(ApiError, match="100001 levels deep"):
        parse(deep, CompletionRequest)
    print(f"a {len(deep)}-byte body 100,001 levels deep refused in {time.perf_counter() - start:.4f} s")


def test_deep_tool_call_arguments_are_refused_before_the_template_parses_them():
    args = "[" * 100_000 + "]" * 100_000
    # a template that writes each call's arguments with tojson, as real ones do: they reach it parsed
    template = ChatTemplate({"default": "{% for m in messages %}{{ m.tool_calls | tojson }}{% endfor %}"}, {})
    r = post(front(template=template), "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "json_too_deep", r.text
    assert err["param"] == "messages.1.tool_calls.0.function.arguments" and "100000 levels" in err["message"]


@pytest.mark.parametrize("plan, text", [
    (ToolPlan("auto", LLAMA3_JSON), '{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}"),
    (ToolPlan("auto", HERMES), '<tool_call>{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}</tool_call>"),
    (ToolPlan("required"), "[" * 5000 + "]" * 5000),
    (ToolPlan("auto", LLAMA3_JSON), '{"name": "f", "arguments": "' + "[" * 5000 + '"}'),
])
def test_model_output_nested_past_the_parser_is_content_not_a_crash(plan, text):
    assert plan.parse(text) == (text, [])


def test_the_default_body_limit_admits_the_largest_legal_request():
    f = front()
    cap = f.servicer.cap
    assert f.limits.max_body_bytes == largest_request_bytes(cap.context_length, cap.vocab_size, 1)
    assert front(Limits(max_body_bytes=12345)).limits.max_body_bytes == 12345
    # MAX_CHOICES prompts, each a full context of the largest token id, as Python writes JSON
    widest = json.dumps({"prompt": [[cap.vocab_size - 1] * (cap.context_length - 1)] * MAX_CHOICES, "max_tokens": 1,
                         "logit_bias": {str(cap.vocab_size - 1 - i): -100.00000000000001 for i in range(1024)},
                         "stop": ["\U0001f600" * 256] * 4, "response_format": {"type": "json_schema", "json_schema": {
                             "name": "s", "schema": {"description": "x" * 60_000}}}}).encode()
    assert len(widest) <= f.limits.max_body_bytes < 2 * len(widest), (len(widest), f.limits.max_body_bytes)
    print(f"largest legal body {len(widest)} bytes; the derived limit {f.limits.max_body_bytes}")
    r = post(f, "/v1/completions", b" " * (f.limits.max_body_bytes + 1))
    assert r.status_code == 413 and r.json()["error"]["message"] == \
        f"body of {f.limits.max_body_bytes + 1} bytes (Content-Length); the limit is {f.limits.max_body_bytes}"
