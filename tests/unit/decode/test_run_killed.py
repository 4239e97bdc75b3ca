"""Decode.Run's two waits (run.py) against fakes: the guards a mutation pass found no test failing without (issue 18,
point 8). The queue for pages: a request that arrives while others wait queues behind them even when it would fit;
draining ends every queued wait with a retryable DRAINING; a queued request whose Grant fails for another reason
than a short pool gets that error at once, not a queue timeout. The wait for the write-done notice: it ends when
decode goes blind, at the allocation timeout or at the caller's deadline, each with its own reason; a loss of
events or a late notice after one never raises inside the revocation stream's loop."""
import asyncio
import time

import grpc
import pytest

from pdserve.common.errors import PdError
from pdserve.common.proto import broker_pb2
from pdserve.decode.allocations import Allocation
from pdserve.decode.run import Notices
from tests.unit.decode.test_run import Pool


class Failing(Pool):
    """A pool whose Grant fails with `fail` once set (a broker that restarted, a decode gone blind)."""

    fail: PdError | None = None

    async def grant(self, owner, need):
        if self.fail is not None:
            self.grants += 1
            raise self.fail
        return await super().grant(owner, need)


def test_a_request_arriving_while_others_wait_queues_behind_them_even_when_it_would_fit():
    async def main():
        pool = Pool(free=0)
        big = asyncio.create_task(pool._granted(b"big", 4, 1, None))
        await asyncio.sleep(0.05)
        pool.free = 2  # freed without a wake-up: the head does not fit anyway
        small = asyncio.create_task(pool._granted(b"small", 1, 1, None))
        await asyncio.sleep(0.05)
        assert pool.order == [] and len(pool._queue) == 2  # 2 free pages, and the newcomer did not take one
        pool.give_back(2)
        await big
        pool.give_back(1)
        await small
        return pool
    pool = asyncio.run(main())
    assert pool.order == [b"big", b"small"] and pool.free == 0


def test_draining_ends_every_queued_wait_with_a_retryable_draining_error():
    async def main():
        pool = Pool(free=0)
        state = {"draining": False}
        pool.is_draining = lambda: state["draining"]
        waiting = [asyncio.create_task(pool._granted(o, n, 1, None)) for o, n in ((b"a", 4), (b"b", 2))]
        await asyncio.sleep(0.05)
        state["draining"] = True
        pool.pages_may_be_free()  # what drain() does after setting the flag
        return await asyncio.gather(*waiting, return_exceptions=True), pool
    results, pool = asyncio.run(main())
    assert [(e.code, e.reason) for e in results] == [(grpc.StatusCode.UNAVAILABLE, "DRAINING")] * 2
    assert "4 pages were awaited" in results[0].message and "2 pages were awaited" in results[1].message
    assert pool.order == [] and not pool._queue


def test_a_queued_grant_that_fails_for_another_reason_than_a_short_pool_ends_the_wait_with_that_error():
    async def main():
        pool = Failing(free=0, timeout_s=30.0)
        task = asyncio.create_task(pool._granted(b"a", 1, 1, None))
        await asyncio.sleep(0.05)
        assert not task.done() and len(pool._queue) == 1  # short of pages: it waits
        pool.fail = PdError(grpc.StatusCode.UNAVAILABLE, "BROKER_RESTARTED", "epoch 0x1 -> 0x2")
        pool.give_back(1)  # woken, the head tries again and the broker has moved meanwhile
        with pytest.raises(PdError) as e:
            await asyncio.wait_for(task, 10)
        return e.value, pool
    err, pool = asyncio.run(main())
    # not a QUEUE_TIMEOUT 30 s later: the caller learns at once that a retry elsewhere may succeed
    assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, "BROKER_RESTARTED") and "0x2" in err.message
    assert not pool._queue


BLIND = PdError(grpc.StatusCode.UNAVAILABLE, "WATCH_BLIND", "decode has not heard from the stream for 2.00s")


def _waiting(blind=lambda: None, alloc_in_s: float = 5.0):
    notices = Notices(16, blind)
    alloc = Allocation(7, [(4, 9), (5, 9)], 20, 8, time.monotonic() + alloc_in_s, "p")
    return notices, alloc, notices.expect(b"o" * 16)


def test_a_notice_or_a_second_loss_after_the_stream_lost_events_leaves_the_watch_running():
    """lost() and on_notice() run inside the revocation stream's loop: one raising there would end decode's watch
    and leave it blind for good."""
    async def main():
        notices, _, fut = _waiting()
        notices.lost("lost events after seq 4")
        notices.lost("lost events after seq 9")  # a second gap before the Run looked
        notices.on_notice(broker_pb2.Revocation(owner=b"o" * 16, epoch=7, write_done=True))  # the replayed notice
        return fut
    fut = asyncio.run(main())
    err = fut.exception()
    assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, "NOTICE_LOST") and "seq 4" in err.message


def test_a_run_waiting_for_its_notice_ends_as_soon_as_decode_goes_blind():
    async def main():
        notices, alloc, fut = _waiting(blind=lambda: BLIND)
        with pytest.raises(PdError) as e:
            await asyncio.wait_for(notices.wait(b"o" * 16, alloc, fut, None, b"d" * 16, 5.0), 10)
        return e.value
    assert asyncio.run(main()) is BLIND  # retryable, rather than a wait until the allocation times out


@pytest.mark.parametrize("first", ["allocation", "caller"])
def test_a_notice_that_never_comes_ends_the_wait_at_the_allocation_timeout_or_the_callers_deadline(first):
    async def main():
        notices, alloc, fut = _waiting(alloc_in_s=0.05 if first == "allocation" else 30.0)
        deadline = time.monotonic() + 0.05 if first == "caller" else None
        with pytest.raises(PdError) as e:
            await asyncio.wait_for(notices.wait(b"o" * 16, alloc, fut, deadline, b"d" * 16, 30.0), 10)
        return e.value
    err = asyncio.run(main())
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED
    if first == "allocation":
        assert err.reason == "NO_WRITE" and "within 30s" in err.message and ("6f" * 16) in err.message
    else:
        assert err.reason == "DEADLINE_EXCEEDED" and "while decode waited for prefill's write" in err.message
