"""Decode's drain past its timeout hands each running stream back with the exact count of tokens it sent: a running
one at once, a joining one (verifying, sending its first token) once it runs; one still joining past the hand-back
bound ends DRAINING, with no count. The real scheduler and its loop; the servicer around them is a stand-in."""
import asyncio
from types import SimpleNamespace

import grpc

from pdserve.common.errors import PdError
from pdserve.decode import drain as drain_mod
from pdserve.decode.scheduler import Scheduler, Sequence
from pdserve.engine.sampler import SamplingParams
from pdserve.engine.tags import expected_tags


def _seq(owner: int, generated: list[int]) -> Sequence:
    # no leased page for its next step: the loop never steps it (no model here), it only ends it once marked
    o = bytes([owner]) * 16
    return Sequence(o, 7, [], expected_tags(o, 7, []), 5, SamplingParams(max_tokens=100), frozenset(), generated)


class _Decode:
    """What drain reads of decode's servicer."""

    def __init__(self):
        self.released: list[bytes] = []

        async def release(seq):
            self.released.append(seq.owner)
        self.scheduler = Scheduler(runner=SimpleNamespace(page_size=16), release=release)
        self.requests = self.scheduler.requests
        self.allocations = self.requests.allocations
        self.queue = SimpleNamespace(pages_may_be_free=lambda: None)
        self.draining = False

    def queue_depth(self) -> int:
        return len(self.allocations) + len(self.scheduler.joining) + len(self.scheduler.running)


def _ended_with(seq: Sequence) -> PdError:
    event = seq.events.get_nowait()
    assert isinstance(event, PdError), event
    return event


def test_running_and_joining_streams_are_handed_back_with_the_tokens_each_sent():
    async def main():
        d = _Decode()
        s = d.scheduler
        loop = asyncio.get_running_loop().create_task(s.run())
        running, joining = _seq(1, [10, 11, 12]), _seq(2, [20])
        s.join(running)
        s.add(running)
        s.join(joining)

        async def starts_later():  # its first token went out; it starts running after the drain timeout
            await asyncio.sleep(0.3)
            s.add(joining)
        starter = asyncio.get_running_loop().create_task(starts_later())
        await asyncio.wait_for(drain_mod.drain(d, 0.1), 10)
        await starter
        loop.cancel()
        return d, running, joining

    d, running, joining = asyncio.run(main())
    assert d.draining
    for seq, n in ((running, 3), (joining, 1)):
        err = _ended_with(seq)
        assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, "DRAINED"), err
        assert err.metadata == {"tokens_streamed": str(n)} and f"handed back after {n} tokens" in err.message
    assert sorted(d.released) == sorted([running.owner, joining.owner])  # each released once, by the scheduler


def test_a_stream_still_joining_past_the_bound_ends_draining_without_a_count(monkeypatch):
    monkeypatch.setattr(drain_mod, "HAND_BACK_S", 0.2)

    async def main():
        d = _Decode()
        stuck = _seq(3, [30])
        d.scheduler.join(stuck)
        await asyncio.wait_for(drain_mod.drain(d, 0.05), 10)
        return stuck

    stuck = asyncio.run(main())
    assert stuck.cancelled and (stuck.err.code, stuck.err.reason) == (grpc.StatusCode.UNAVAILABLE, "DRAINING")
    assert "tokens_streamed" not in stuck.err.metadata
