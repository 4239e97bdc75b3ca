"""A decode stream that stops sending after some tokens: the gateway's wait for each next token is bounded by
--token-timeout (DECODE_STALLED, naming the tokens sent) and by the request's deadline (DEADLINE_EXCEEDED), the client
keeps the tokens it got, and decode's Run stream is cancelled. A client that leaves while the gateway waits cancels
the wait itself, not as a timeout."""
import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest

from pdserve.common.errors import PdError
from pdserve.common.proto import common_pb2, decode_pb2, gateway_pb2, prefill_pb2
from pdserve.engine.tokenizer import ByteTokenizer
from pdserve.gateway.router import Backend, Router
from pdserve.gateway.servicer import Capacity, GatewayServicer

TOKENS = [72, 105, 33]


class Stalls:
    """Run: the destination, TOKENS, then nothing until cancelled."""

    def __init__(self):
        self.events = [decode_pb2.RunEvent(destination=common_pb2.Destination(pool_id="p"))]
        self.events += [decode_pb2.RunEvent(token=decode_pb2.DecodeResponse(token_id=t)) for t in TOKENS]
        self.cancelled = False

    async def read(self):
        if self.events:
            return self.events.pop(0)
        await asyncio.sleep(3600)

    def cancel(self):
        self.cancelled = True


class Decode:
    def __init__(self):
        self.calls: list[Stalls] = []

    def Run(self, req, timeout):
        self.calls.append(Stalls())
        return self.calls[-1]


class Prefill:
    async def Prefill(self, req, timeout):
        return prefill_pb2.PrefillResponse()


def gateway(token_timeout_s: float) -> tuple[GatewayServicer, Decode]:
    info = SimpleNamespace(free_pages=100, queue_depth=0)
    decode = Decode()
    gw = GatewayServicer(Router("prefill", [Backend("pf", Prefill(), info)]),
                         Router("decode", [Backend("dc", decode, info)]), ByteTokenizer(512),
                         Capacity("m", 4096, 512, 16, 100, 4096), token_timeout_s=token_timeout_s)
    return gw, decode


async def run(gw, deadline=None) -> tuple[list[int], PdError]:
    got = []
    req = gateway_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=16, ignore_eos=True)
    with pytest.raises(PdError) as e:
        async for r in gw.generate(req, deadline):
            got.extend(r.token_ids)
    return got, e.value


def test_a_stalled_stream_ends_after_the_token_timeout_with_the_tokens_sent():
    gw, decode = gateway(token_timeout_s=0.2)
    got, err = asyncio.run(run(gw))
    assert got == TOKENS
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and err.reason == "DECODE_STALLED", err
    assert "after 3 tokens" in err.message and "dc" in err.message, err.message
    assert decode.calls[0].cancelled


def test_a_stalled_stream_ends_at_the_request_deadline_when_that_comes_first():
    gw, decode = gateway(token_timeout_s=60)
    got, err = asyncio.run(run(gw, deadline=time.monotonic() + 0.3))
    assert got == TOKENS
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and err.reason == "DEADLINE_EXCEEDED", err
    assert "after 3 tokens" in err.message, err.message
    assert decode.calls[0].cancelled


def test_a_client_that_leaves_during_the_wait_is_a_cancellation_not_a_timeout():
    gw, decode = gateway(token_timeout_s=60)

    async def main():
        got = []

        async def consume():
            req = gateway_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=16, ignore_eos=True)
            async for r in gw.generate(req):
                got.extend(r.token_ids)
        task = asyncio.ensure_future(consume())
        while len(got) < len(TOKENS):
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return got
    assert asyncio.run(main()) == TOKENS
    assert decode.calls[0].cancelled and gw.active == 0 and gw.streaming == 0
