"""The SSE writer's cheap paths: a chunk's shared fields encoded once (ChunkFormat) give the bytes json.dumps gave for
the whole chunk, whatever the token's text (quotes, backslashes, control characters, non-ASCII, U+FFFD, a lone
surrogate); messages that arrived while the last write went out go out in one write, and one that arrives alone is
written before the next exists; a failure still writes every event before it, then the error event and [DONE]."""
import asyncio
import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import grpc

from pdserve.common.proto import common_pb2, decode_pb2, gateway_pb2
from pdserve.engine.chat import ChatTemplate
from pdserve.engine.tokenizer import ByteTokenizer
from pdserve.gateway.openai.app import Front
from pdserve.gateway.openai.server import Limits
from pdserve.gateway.router import Backend, Router
from pdserve.gateway.servicer import Capacity, GatewayServicer
from pdserve.gateway.openai.generation import Merged
from pdserve.gateway.openai.stream import ChunkFormat, event_stream
from tests.unit.gateway.test_http_failures import RID, Prefill, events, post

ODD = ['"', "\\", '\\"', "\x00", "\x1f", "\n\r\t", "\x7f", "é", "\u2028\u2029", "日本", "🙂", "\ufffd", "</script>",
       "", "data: [DONE]\n\n"]
HEAD = {"id": "cmpl-0123", "object": "text_completion", "created": 1765000000, "model": 'm"\\odd'}


def old_event(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


@pytest.mark.parametrize("text", ODD)
def test_a_chunk_is_the_bytes_json_dumps_gave(text):
    fields = {"choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None, "token_ids": [1, 2]}]}
    for more in ({}, {"usage": None}, {"usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}):
        assert ChunkFormat(HEAD).event({**fields, **more}) == old_event({**HEAD, **fields, **more})
    assert ChunkFormat().event(fields) == old_event(fields)  # no head: the fields are the whole chunk


@settings(max_examples=300, deadline=None)
@given(st.text(), st.one_of(st.none(), st.floats(allow_nan=False), st.integers()))
def test_any_text_encodes_as_json_dumps_did(text, number):
    fields = {"choices": [{"index": 3, "delta": {"content": text}, "logprobs": number, "finish_reason": "stop"}]}
    head = {**HEAD, "object": "chat.completion.chunk", "model": text}
    assert ChunkFormat(head).event(fields) == old_event({**head, **fields})


def test_a_lone_surrogate_fails_as_it_did():
    fields = {"choices": [{"text": "a\ud800b"}]}
    with pytest.raises(UnicodeEncodeError):
        old_event({**HEAD, **fields})
    with pytest.raises(UnicodeEncodeError):
        ChunkFormat(HEAD).event(fields)


ODD_TOKENS = [34, 92, 0, 10, 31, 127, 0xC3, 0xA9, 0xFF, 0xE6, 0x97, 65, 0xA5, 60, 47]  # '"', '\\', controls, é, bad bytes


class OddRun:
    """Decode's Run stream: the destination, then ODD_TOKENS, the last one ending the output (length)."""

    def __init__(self):
        last = len(ODD_TOKENS) - 1
        self.events = [decode_pb2.RunEvent(destination=common_pb2.Destination(pool_id="p"))]
        self.events += [decode_pb2.RunEvent(token=decode_pb2.DecodeResponse(
            token_id=t, finish_reason=common_pb2.FINISH_REASON_LENGTH if k == last else 0))
            for k, t in enumerate(ODD_TOKENS)]

    async def read(self):
        return self.events.pop(0) if self.events else grpc.aio.EOF

    def cancel(self):
        pass


class OddDecode:
    def Run(self, req, timeout):
        return OddRun()


def odd_front() -> Front:
    info = SimpleNamespace(free_pages=100, queue_depth=0)
    gw = GatewayServicer(Router("prefill", [Backend("pf", Prefill(), info)]),
                         Router("decode", [Backend("dc", OddDecode(), info)]), ByteTokenizer(512),
                         Capacity("m", 4096, 512, 16, 100, 4096))
    return Front(gw, ["m"], Limits(), None)


@pytest.mark.parametrize("path, head", [("/v1/completions", ["id", "object", "created", "model", "choices"]),
                                        ("/v1/chat/completions", ["id", "created", "model", "object", "choices"])])
def test_odd_token_texts_through_the_front_parse_as_before(path, head):
    """Over the byte tokenizer: every event is the canonical json.dumps of what it parses to (the old encoding), its
    keys in the old order, and the streamed text adds up to the text of the same output not streamed (invalid UTF-8
    as U+FFFD, as there)."""
    body = {"max_tokens": len(ODD_TOKENS), "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    body.update({"prompt": [5, 6, 7]} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]})
    f = odd_front()
    if "chat" in path:
        f.template = ChatTemplate({"default": "{% for m in messages %}{{ m.content }}{% endfor %}"}, {})
    r = post(f, path, body)
    assert r.status_code == 200, r.text
    lines = r.text.split("\n\n")
    assert lines[-2:] == ["data: [DONE]", ""], lines[-3:]
    for line in lines[:-2]:
        obj = json.loads(line[len("data: "):])
        assert line == "data: " + json.dumps(obj, ensure_ascii=False), line
        assert list(obj) == head + ["usage"], obj  # include_usage: usage null on every chunk, then the usage
    got = events(r)
    usage = got[-2]["usage"]
    assert usage["completion_tokens"] == len(ODD_TOKENS) and got[-2]["choices"] == [], got[-2]
    if "chat" in path:
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in got[:-2])
        whole = post(f, path, {**body, "stream": False, "stream_options": None}).json()
        assert text == whole["choices"][0]["message"]["content"]
    else:
        text = "".join(c["choices"][0]["text"] for c in got[:-2])
        whole = post(f, path, {**body, "stream": False, "stream_options": None}).json()
        assert text == whole["choices"][0]["text"]
        assert [t for c in got[:-2] for t in c["choices"][0]["token_ids"]] == ODD_TOKENS
    assert '"' in text and "\\" in text and "\x00" in text and "é" in text and "\ufffd" in text, repr(text)


class Servicer:
    """generate(req): one message per item of req.prompt_token_ids; where a gate (asyncio.Event) is given for an
    index, it waits for it before that message."""

    def __init__(self, gates: dict[int, asyncio.Event], fail_after: int | None = None):
        self.gates, self.fail_after = gates, fail_after

    async def generate(self, req, deadline, tenant):
        for k, t in enumerate(req.prompt_token_ids):
            if k in self.gates:
                await self.gates[k].wait()
            if k == self.fail_after:
                raise RuntimeError("stub: broken after its messages")
            yield gateway_pb2.GenerateResponse(token_ids=[t], text=chr(t))


def chunks(i, r):
    yield {"n": r.text}


async def parts_of(servicer, n: int, on_part=None) -> list[bytes]:
    gen = Merged(servicer, [gateway_pb2.GenerateRequest(prompt_token_ids=range(65, 65 + n))], RID)
    first = await gen.__anext__()
    parts = []
    async for p in event_stream(gen, first, chunks, lambda: iter(()), RID).body_iterator:
        parts.append(p)
        if on_part is not None:
            on_part(len(parts))
    return parts


def test_queued_messages_go_out_in_one_write_and_a_lone_one_at_once():
    async def main():
        gates = {1: asyncio.Event(), 4: asyncio.Event()}

        def on_part(n):  # the write of message 0 came while message 1 did not exist yet: then 1..3 arrive together
            if n == 1:
                gates[1].set()
            elif n == 2:
                gates[4].set()
        return await parts_of(Servicer(gates), 5, on_part)
    parts = asyncio.run(main())
    assert parts == [b'data: {"n": "A"}\n\n', b'data: {"n": "B"}\n\ndata: {"n": "C"}\n\ndata: {"n": "D"}\n\n',
                     b'data: {"n": "E"}\n\n', b"data: [DONE]\n\n"], parts


def test_an_error_behind_queued_messages_comes_after_them():
    async def main():
        gate = asyncio.Event()
        return await parts_of(Servicer({1: gate}, fail_after=3), 5, lambda n: gate.set())
    parts = asyncio.run(main())
    assert parts[:2] == [b'data: {"n": "A"}\n\n', b'data: {"n": "B"}\n\ndata: {"n": "C"}\n\n'], parts
    assert json.loads(parts[2][len("data: "):])["error"]["code"] == "internal_error" and parts[3] == b"data: [DONE]\n\n"


def test_a_formatting_failure_in_a_batch_still_writes_the_events_before_it():
    def failing(i, r):
        if r.text == "C":
            raise KeyError("stub: formatting")
        yield {"n": r.text}

    async def main():
        gate = asyncio.Event()
        gen = Merged(Servicer({1: gate}), [gateway_pb2.GenerateRequest(prompt_token_ids=range(65, 69))], RID)
        first = await gen.__anext__()
        parts = []
        async for p in event_stream(gen, first, failing, lambda: iter(()), RID).body_iterator:
            parts.append(p)
            gate.set()
        return parts
    parts = asyncio.run(main())
    assert parts[:2] == [b'data: {"n": "A"}\n\n', b'data: {"n": "B"}\n\n'], parts
    assert b"internal_error" in parts[2] and parts[3] == b"data: [DONE]\n\n" and len(parts) == 4
