"""GatewayServicer.generate with a deadline, against stub backends that record what they are asked: every internal
call gets at most the time left, and a deadline that passes (in the queue for pages, or during prefill) ends the
request with DEADLINE_EXCEEDED and its numbers, and decode's Run stream (which holds the pages) is cancelled."""
import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest

from pdserve.common.errors import PdError
from pdserve.common.proto import common_pb2, decode_pb2, gateway_pb2
from pdserve.engine.tokenizer import ByteTokenizer
from pdserve.gateway.router import Backend, Router
from pdserve.gateway.servicer import Capacity, GatewayServicer


def _rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name)


class Call:
    """Decode's Run stream: the destination first (unless the pool stays full), then nothing until cancelled."""

    def __init__(self, full: bool):
        self.events = [] if full else [decode_pb2.RunEvent(destination=common_pb2.Destination(pool_id="p"))]
        self.cancelled = False

    async def read(self):
        if self.events:
            return self.events.pop(0)
        await asyncio.sleep(3600)

    def cancel(self):
        self.cancelled = True


class Decode:
    def __init__(self, full: bool):
        self.full = full
        self.timeouts: list[float] = []
        self.calls: list[Call] = []

    def Run(self, req, timeout):
        self.timeouts.append(timeout)
        self.calls.append(Call(self.full))
        return self.calls[-1]


class Prefill:
    def __init__(self):
        self.timeouts: list[float] = []

    async def Prefill(self, req, timeout):
        self.timeouts.append(timeout)
        await asyncio.sleep(timeout)  # a prefill that takes longer than it is given
        raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED)


def _gateway(full: bool):
    info = SimpleNamespace(free_pages=100, queue_depth=0)
    decode, prefill = Decode(full), Prefill()
    gw = GatewayServicer(Router("prefill", [Backend("pf", prefill, info)]),
                         Router("decode", [Backend("dc", decode, info)]), ByteTokenizer(512),
                         Capacity("m", 4096, 512, 16, 100, 4096), rpc_timeout_s=60.0)
    return gw, decode, prefill


async def _generate(gw, deadline):
    req = gateway_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=4)
    return [m async for m in gw.generate(req, deadline)]


@pytest.mark.parametrize("full", [False, True], ids=["during prefill", "waiting for pages"])
def test_a_passing_deadline_ends_the_request_and_gives_the_pages_back(full):
    gw, decode, prefill = _gateway(full)

    async def main():
        deadline = time.monotonic() + 0.3
        with pytest.raises(PdError) as e:
            await _generate(gw, deadline)
        await asyncio.sleep(0.05)  # the release is spawned
        return e.value, deadline
    err, deadline = asyncio.run(main())
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and err.reason == "DEADLINE_EXCEEDED", err
    assert "deadline passed" in err.message and "s ago" in err.message
    assert all(t <= 0.3 for t in decode.timeouts + prefill.timeouts)  # not the 60 s bounds
    assert len(decode.calls) == 1 and decode.calls[0].cancelled  # cancelling Run gives the pages back
    if full:
        assert not prefill.timeouts and "before decode granted KV pages" in err.message
    else:
        assert len(prefill.timeouts) == 1 and "during prefill" in err.message


def test_without_a_deadline_each_call_keeps_its_own_bound():
    gw, decode, prefill = _gateway(False)
    prefill.Prefill = lambda req, timeout: _fail_fast(prefill, timeout)
    with pytest.raises(PdError) as e:
        asyncio.run(_generate(gw, None))
    assert e.value.code == grpc.StatusCode.INTERNAL
    # the prefill bound: 60 s plus 5 ms for each of the 3 prompt tokens
    assert decode.timeouts == [None] and prefill.timeouts == [pytest.approx(60.015)] and decode.calls[0].cancelled


def test_the_prefill_bound_grows_with_the_prompt():
    """A bound sized for short prompts would cut off a long prompt's forward pass (16k tokens took ~50 s on a busy
    2-core machine, against the 60 s default): it grows by --prefill-timeout-per-token per prompt token."""
    gw, decode, prefill = _gateway(False)
    gw.cap = Capacity("m", 8192, 512, 16, 1000, 8192)  # room for the prompt
    prefill.Prefill = lambda req, timeout: _fail_fast(prefill, timeout)
    req = gateway_pb2.GenerateRequest(prompt_token_ids=[5] * 4000, max_tokens=4)
    with pytest.raises(PdError):
        asyncio.run(_collect(gw, req))
    assert prefill.timeouts == [pytest.approx(60.0 + 4000 * 0.005)]


async def _collect(gw, req):
    return [m async for m in gw.generate(req, None)]


async def _fail_fast(prefill, timeout):
    prefill.timeouts.append(timeout)
    raise _rpc_error(grpc.StatusCode.INTERNAL)
