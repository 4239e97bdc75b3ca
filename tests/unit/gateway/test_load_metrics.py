"""The gateway's token counters and its running/waiting gauges (issue 21), over stub backends (test_resubmit.py's):
a generation counts its prompt once, when its first token goes out, and every token it streams, a preempted and
resubmitted one included; a refused one counts nothing. A generation waits until its first token and runs after
it; the gauges read the servicer's counts at scrape time."""
import asyncio
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import REGISTRY

from pdserve.common.errors import PdError
from pdserve.common.metrics import track_load
from pdserve.common.proto import gateway_pb2
from pdserve.engine.tokenizer import ByteTokenizer
from pdserve.gateway.router import Backend, Router
from pdserve.gateway.servicer import Capacity, GatewayServicer
from tests.unit.gateway.test_resubmit import PROMPT, Decode, Prefill, Run, _generate


def value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def tokens() -> tuple[float, float]:
    return value("pdserve_prompt_tokens_total"), value("pdserve_generation_tokens_total")


def test_a_generation_counts_its_prompt_once_and_every_token_it_streams():
    before = tokens()
    got, err, _, _ = _generate([([65, 66, 67, 68], None, None)], max_tokens=4)
    assert err is None and len(got) == 4
    assert tuple(a - b for a, b in zip(tokens(), before)) == (len(PROMPT), 4)


def test_a_preempted_generation_counts_its_prompt_once_and_each_token_once():
    """Resubmitted as prompt + 3 streamed tokens: prefill computes 6 tokens, the client's prompt is still 3."""
    before = tokens()
    got, err, _, prefill = _generate([([65, 66, 67], 3, None), ([68, 69, 70, 71], None, None)])
    assert err is None and len(prefill.requests) == 2
    assert tuple(a - b for a, b in zip(tokens(), before)) == (len(PROMPT), 7)


def test_a_refused_generation_counts_no_token():
    before = tokens()
    got, err, decode, _ = _generate([([65], None, None)], max_tokens=5000)  # over the context
    assert err is not None and err.code == grpc.StatusCode.INVALID_ARGUMENT and decode.requests == []
    assert tokens() == before


class HeldRun(Run):
    """A Run stream whose every token waits for the test to let it go (prefill computing the first one, a decode step
    each of the others)."""

    def __init__(self, tokens: list[int]):
        super().__init__(tokens, None, None)
        self.gates = [asyncio.Event() for _ in tokens]
        self.sent = 0

    async def read(self):
        if self.events and self.events[0].HasField("token"):
            await self.gates[self.sent].wait()
            self.sent += 1
        return await super().read()


async def settle() -> None:
    """Lets every task run until it waits on something only the test sets (the stubs never wait otherwise)."""
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_generation_waits_until_its_first_token_then_runs_and_the_gauges_say_so():
    info = SimpleNamespace(free_pages=100, queue_depth=0)
    run = None

    class Held(Decode):
        def Run(self, req, timeout):
            nonlocal run
            self.requests.append(req)
            run = HeldRun([65, 66])
            return run

    gw = GatewayServicer(Router("prefill", [Backend("pf", Prefill(), info)]),
                         Router("decode", [Backend("dc", Held([]), info)]), ByteTokenizer(512),
                         Capacity("m", 4096, 512, 16, 100, 4096))
    track_load("gateway", gw.load)

    def gauges() -> tuple[float, float]:
        return value("pdserve_requests_running", service="gateway"), value("pdserve_requests_waiting", service="gateway")

    async def main():
        req = gateway_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=2, ignore_eos=True)
        stream = gw.generate(req).__aiter__()
        first = asyncio.ensure_future(stream.__anext__())
        await settle()
        assert not first.done() and gw.load() == (0, 1) and gauges() == (0, 1)  # no first token yet: waiting
        run.gates[0].set()
        assert (await first).token_ids == [65]
        assert gw.load() == (1, 0) and gauges() == (1, 0)  # streaming: running
        second = asyncio.ensure_future(stream.__anext__())
        await settle()
        assert not second.done() and gw.load() == (1, 0)
        run.gates[1].set()
        assert (await second).token_ids == [66]
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        assert gw.load() == (0, 0) and gauges() == (0, 0)
    asyncio.run(main())


def test_a_failure_before_the_first_token_leaves_nothing_running_or_waiting():
    info = SimpleNamespace(free_pages=100, queue_depth=0)
    gw = GatewayServicer(Router("prefill", [Backend("pf", Prefill(), info)]), Router("decode", []),
                         ByteTokenizer(512), Capacity("m", 4096, 512, 16, 100, 4096))

    async def main():
        req = gateway_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=2, ignore_eos=True)
        with pytest.raises(PdError) as e:
            async for _ in gw.generate(req):
                pass
        assert e.value.reason == "NO_BACKEND"
    asyncio.run(main())
    assert gw.load() == (0, 0)
