"""Decode blind on its revocation stream: the scheduler fails what runs and starts nothing, and decode's
bound must stay under half the broker's lock_delay."""
import asyncio

import grpc
import pytest

from pdserve.common.errors import PdError
from pdserve.decode.scheduler import Scheduler, Sequence
from pdserve.decode.watch import blind_bound_error
from pdserve.engine.sampler import SamplingParams
from pdserve.engine.tags import expected_tags

LEASES = [(3, 1), (4, 1)]
BLIND = PdError(grpc.StatusCode.UNAVAILABLE, "WATCH_BLIND", "decode has not heard from the stream for 2.00s")


def _seq(owner: bytes) -> Sequence:
    return Sequence(owner, 7, LEASES, expected_tags(owner, 7, LEASES), 5, SamplingParams(max_tokens=8), frozenset(), [1])


def test_a_blind_scheduler_fails_running_requests_without_a_step_and_refuses_new_ones():
    async def main():
        state = {"blind": None}
        released = []

        async def release(seq):
            released.append(seq.owner)
        s = Scheduler(runner=None, release=release, blind=lambda: state["blind"])  # any step would crash
        running = _seq(b"r" * 16)
        s.join(running)
        s.add(running)
        state["blind"] = BLIND
        loop = asyncio.create_task(s.run())
        try:
            assert await asyncio.wait_for(running.events.get(), 5) is BLIND
            assert running.done and s.running == {} and running.generated == [1]  # no token after it
            late = _seq(b"n" * 16)
            s.join(late)
            with pytest.raises(PdError) as e:
                s.add(late)
            assert e.value is BLIND
            await asyncio.sleep(0.05)
            assert released == [running.owner]
        finally:
            loop.cancel()
    asyncio.run(main())


def test_the_blind_bound_is_at_most_half_the_lock_delay_and_the_refusal_names_both():
    assert blind_bound_error(1.0, 2000) is None
    assert blind_bound_error(0.5, 1000) is None
    msg = blind_bound_error(1.5, 2000)
    assert "--max-blind 1.5s" in msg and "lock_delay 2s" in msg and "1s" in msg
    assert blind_bound_error(0.0, 2000) is not None
