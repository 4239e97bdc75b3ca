"""The OpenAI front's log: one INFO line per admitted request, written when it ends (off its first token's path),
naming the request id, what was asked, every internal request id, the tokens, the times and how it ended; nothing at
INFO before that, and nothing for a request refused before its first message (a flood of refusals costs no lines)."""
import asyncio
import json
import logging
from types import SimpleNamespace

import httpx

from pdserve.common.errors import PdError
from pdserve.common.proto import common_pb2, gateway_pb2
from pdserve.engine.tokenizer import ByteTokenizer
from pdserve.gateway.openai.app import Front, create_app
from pdserve.gateway.openai.generation import Merged
from pdserve.gateway.openai.server import Limits

import grpc

RID = "req-log-0001"
INTERNAL = [bytes([0xA0 + i]) * 16 for i in range(4)]


class Servicer:
    """generate(): `tokens` messages (the first with an internal id), then a failure when `fail` is set; refused
    before any message when `refuse` is."""

    def __init__(self, tokens=3, fail=None, refuse=False):
        self.tokenizer = ByteTokenizer(512)
        self.cap = SimpleNamespace(context_length=4096, vocab_size=512, page_size=16, decode_pool_pages=100,
                                   prefill_pool_tokens=4096, model="m")
        self.draining, self.tokens, self.fail, self.refuse = False, tokens, fail, refuse
        self.calls = 0

    async def generate(self, request, deadline=None, tenant=None):
        k, self.calls = self.calls, self.calls + 1
        if self.refuse:
            raise PdError(grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED", "no room")
        for t in range(self.tokens):
            r = gateway_pb2.GenerateResponse(token_ids=[65 + t], text=chr(65 + t))
            if t == 0:
                r.request_id, r.prompt_tokens = INTERNAL[k], 3
            if t == self.tokens - 1 and self.fail is None:
                r.finish_reason = common_pb2.FINISH_REASON_LENGTH
            yield r
        if self.fail is not None:
            raise self.fail


def front_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("pdserve.gateway.openai") and r.levelno >= logging.INFO]


def test_a_stream_logs_one_line_at_its_end_and_none_before(caplog):
    caplog.set_level(logging.INFO)

    async def main():
        gen = Merged(Servicer(), [gateway_pb2.GenerateRequest()] * 2, RID, what="completion, 1 prompt(s) x 2")
        first = await gen.__anext__()
        assert first[1].token_ids == [65]
        assert front_lines(caplog) == []  # the first token's path writes no INFO line
        got = [first] + [m async for m in gen]
        assert front_lines(caplog) == []
        await gen.aclose()
        return got

    got = asyncio.run(main())
    assert sorted(r.token_ids[0] for _, r in got) == [65, 65, 66, 66, 67, 67]
    [line] = front_lines(caplog)
    assert line.startswith(f"http request {RID}: completion, 1 prompt(s) x 2; internal ")
    assert f"0:{INTERNAL[0].hex()}" in line and f"1:{INTERNAL[1].hex()}" in line
    assert "; 6 tokens, first message at " in line and line.endswith("; ok")


def test_a_refused_request_logs_nothing(caplog):
    caplog.set_level(logging.INFO)

    async def main():
        gen = Merged(Servicer(refuse=True), [gateway_pb2.GenerateRequest()], RID)
        try:
            await gen.__anext__()
        except PdError as e:
            assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        else:
            raise AssertionError("the refusal was not raised")
        finally:
            await gen.aclose()

    asyncio.run(main())
    assert front_lines(caplog) == []


def test_a_failure_after_the_first_message_is_named_in_the_line(caplog):
    caplog.set_level(logging.INFO)

    async def main():
        gen = Merged(Servicer(tokens=2, fail=PdError(grpc.StatusCode.UNAVAILABLE, "DECODE_GONE", "decode gone")),
                     [gateway_pb2.GenerateRequest()], RID)
        seen = []
        try:
            async for _, r in gen:
                seen.extend(r.token_ids)
        except PdError:
            pass
        finally:
            await gen.aclose()
        return seen

    assert asyncio.run(main()) == [65, 66]
    [line] = front_lines(caplog)
    assert f"internal 0:{INTERNAL[0].hex()}" in line and "; 2 tokens," in line and line.endswith("; UNAVAILABLE DECODE_GONE")


def test_a_client_that_leaves_mid_stream_is_logged_as_cancelled(caplog):
    caplog.set_level(logging.INFO)

    async def main():
        gen = Merged(Servicer(tokens=3), [gateway_pb2.GenerateRequest()], RID)
        await gen.__anext__()
        await gen.aclose()

    asyncio.run(main())
    [line] = front_lines(caplog)
    assert f"internal 0:{INTERNAL[0].hex()}" in line and line.endswith("; cancelled")


def test_an_http_stream_gives_its_bytes_and_one_line(caplog):
    caplog.set_level(logging.INFO)
    front = Front(Servicer(), ["m"], Limits(max_body_bytes=1 << 20))

    async def main():
        transport = httpx.ASGITransport(app=create_app(front, None))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 3, "stream": True, "user": "u1"}
            return await c.post("/v1/completions", content=json.dumps(body).encode(),
                                headers={"X-Request-Id": RID, "Content-Type": "application/json"})

    r = asyncio.run(main())
    assert r.status_code == 200
    events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == ["A", "B", "C"]
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[65], [66], [67]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    [line] = front_lines(caplog)
    assert line.startswith(f"http request {RID}: completion, 1 prompt(s) x 1 choice(s), user 'u1'; internal 0:")
    assert INTERNAL[0].hex() in line and "; 3 tokens," in line and line.endswith("; ok")
