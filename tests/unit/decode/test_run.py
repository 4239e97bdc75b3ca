"""Decode.Run (run.py) against fakes. The allocation queue: requests wait in arrival order while the pool is
short, are woken by freed pages rather than polling, and the queue is bounded in length and time. The wait for the
write-done notice: only a notice naming exactly the prompt leases starts decoding; an ended allocation or a
stream that lost events ends the wait."""
import asyncio
import time

import grpc
import pytest
from prometheus_client import REGISTRY

from pdserve.common.errors import PdError
from pdserve.common.proto import broker_pb2, common_pb2
from pdserve.common.wire import prompt_digest
from pdserve.decode.allocations import Allocation, Allocations
from pdserve.decode.run import GrantQueue, Notices


class Pool(GrantQueue):
    """The queue with a pool of `free` pages; grant() takes them or raises RESOURCE_EXHAUSTED like the broker."""

    def __init__(self, free: int, limit: int = 8, timeout_s: float = 5.0):
        super().__init__(limit, timeout_s)
        self.free, self.pool_id, self.order, self.grants = free, "p", [], 0

    def _granted(self, owner, need, max_tokens, deadline):
        return self.granted(lambda: self.grant(owner, need), need, self.pool_id, deadline)

    async def grant(self, owner, need):
        self.grants += 1
        await asyncio.sleep(0)  # a round trip
        if self.free < need:
            raise PdError(grpc.StatusCode.RESOURCE_EXHAUSTED, "POOL_EXHAUSTED", f"{self.free} free, {need} asked")
        self.free -= need
        self.order.append(owner)
        return owner

    def give_back(self, n: int):
        self.free += n
        self.pages_may_be_free()


def test_waiters_are_granted_in_arrival_order_when_pages_are_freed_without_polling():
    async def main():
        pool = Pool(free=0)
        # the big one first: a small one behind it must not overtake it (no starvation of long prompts)
        tasks = [asyncio.create_task(pool._granted(o, n, 1, None)) for o, n in ((b"big", 4), (b"s1", 1), (b"s2", 1))]
        await asyncio.sleep(0.3)
        assert pool.order == [] and len(pool._queue) == 3
        assert pool.grants <= 4  # one try each on arrival (none waited yet) and one as head: nothing polls while idle
        pool.give_back(2)
        await asyncio.sleep(0.05)
        assert pool.order == []  # 2 free pages do not fit the head; s1 waits behind it
        pool.give_back(4)
        await asyncio.gather(*tasks)
        assert pool.order == [b"big", b"s1", b"s2"] and pool.free == 0 and not pool._queue
        # three got pages within the last 10 s: the one after the next two in line waits about (2 + 1) / 0.3 s
        pool._queue.extend([object(), object()])
        assert pool.retry_after_s() == pytest.approx(10.0)
    asyncio.run(main())


def test_a_full_queue_refuses_at_once_and_a_long_wait_ends_with_queue_timeout():
    async def main():
        pool = Pool(free=0, limit=2, timeout_s=0.2)
        waiting = [asyncio.create_task(pool._granted(bytes([i]), 1, 1, None)) for i in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(PdError) as full:
            await pool._granted(b"x", 1, 1, None)
        results = await asyncio.gather(*waiting, return_exceptions=True)
        return full.value, results, pool
    full, results, pool = asyncio.run(main())
    assert full.code == grpc.StatusCode.RESOURCE_EXHAUSTED and full.reason == "OVERLOADED"
    assert full.retry_after_s == 0.2  # nobody got pages lately: the queue timeout
    assert "2 requests already wait" in full.message and "limit 2" in full.message
    assert [(e.code, e.reason) for e in results] == [(grpc.StatusCode.RESOURCE_EXHAUSTED, "QUEUE_TIMEOUT")] * 2
    assert not pool._queue  # every waiter left the queue


def test_a_waiter_whose_deadline_passes_ends_with_deadline_exceeded_and_the_next_moves_up():
    async def main():
        pool = Pool(free=0)
        first = asyncio.create_task(pool._granted(b"a", 1, 1, time.monotonic() + 0.1))
        second = asyncio.create_task(pool._granted(b"b", 1, 1, None))
        with pytest.raises(PdError) as e:
            await first
        pool.give_back(1)
        assert await second == b"b"
        return e.value
    err = asyncio.run(main())
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED



def queue_times() -> float:
    return REGISTRY.get_sample_value("pdserve_queue_time_seconds_count", {"service": "decode"}) or 0.0


def test_every_granted_request_has_its_queue_time_observed_and_a_refused_one_none():
    """Issue 21: one observation per grant, the ones granted at once and the ones that queued for pages alike."""
    async def main():
        pool = Pool(free=1, limit=1)
        before = queue_times()
        assert await pool._granted(b"now", 1, 1, None) == b"now"  # granted at once
        assert queue_times() - before == 1
        queued = asyncio.create_task(pool._granted(b"later", 1, 1, None))
        await asyncio.sleep(0.05)
        with pytest.raises(PdError):  # the queue (limit 1) is full: refused, never granted
            await pool._granted(b"refused", 1, 1, None)
        assert queue_times() - before == 1 and not queued.done()
        pool.give_back(1)
        assert await queued == b"later"
        assert queue_times() - before == 2
    asyncio.run(main())


def test_decode_counts_running_sequences_and_requests_queued_for_pages():
    """What pdserve_requests_running/_waiting read: the batch and the joining (their KV arrived), and the queue for
    pages; an allocation whose KV prefill still writes is in neither."""
    from types import SimpleNamespace

    from pdserve.decode.servicer import DecodeServicer
    queue = GrantQueue()
    queue._queue.extend([object(), object()])
    fake = SimpleNamespace(scheduler=SimpleNamespace(running={b"a": 1, b"b": 2, b"c": 3}, joining={b"d": 4}),
                           queue=queue, allocations={b"e": 5})
    assert DecodeServicer.load(fake) == (4, 2)


class Waiting(Notices):
    """Notices with one allocation of 3 prompt pages (page size 16, 40-token prompt) waiting for its notice."""

    def __init__(self):
        super().__init__(16, lambda: None)
        self.alloc = Allocation(7, [(4, 9), (5, 9), (6, 9), (7, 9)], 40, 8, time.monotonic() + 5, "p")
        self.allocations = Allocations()
        self.allocations.add(b"o", self.alloc)

    async def wait_for(self, notice=None, act=None):
        fut = self.expect(b"o")
        if act is not None:
            asyncio.get_running_loop().call_later(0.05, act)
        if notice is not None:
            self.on_notice(notice)
        return await self.wait(b"o", self.alloc, fut, None, DIGEST, 5.0)


DIGEST = prompt_digest([5, 6, 7])


def _notice(leases, epoch=7, digest=DIGEST):
    return broker_pb2.Revocation(owner=b"o", epoch=epoch, write_done=True, first_token=3, prompt_digest=digest,
                                 leases=[common_pb2.PageLease(page=p, generation=g) for p, g in leases])


@pytest.mark.parametrize("leases,epoch", [([(4, 9), (5, 9)], 7), ([(4, 9), (5, 9), (6, 9), (7, 9)], 7),
                                          ([(4, 9), (5, 9), (6, 8)], 7), ([(4, 9), (5, 9), (6, 9)], 8)],
                         ids=["a page left out", "a page too many", "another generation", "another epoch"])
def test_a_notice_must_name_exactly_the_prompt_leases(leases, epoch):
    with pytest.raises(PdError) as e:
        asyncio.run(Waiting().wait_for(_notice(leases, epoch)))
    assert (e.value.code, e.value.reason) == (grpc.StatusCode.DATA_LOSS, "NOTICE_MISMATCH")


def test_the_matching_notice_is_returned_and_an_ended_allocation_or_lost_stream_ends_the_wait():
    ok = Waiting()
    assert asyncio.run(ok.wait_for(_notice([(4, 9), (5, 9), (6, 9)]))).first_token == 3
    revoked = Waiting()
    with pytest.raises(PdError) as e:  # what the revocation handler does
        asyncio.run(revoked.wait_for(act=lambda: revoked.allocations.end(b"o", PdError(
            grpc.StatusCode.DATA_LOSS, "REVOKED", "the broker revoked this request's leases: TEST"))))
    assert (e.value.code, e.value.reason) == (grpc.StatusCode.DATA_LOSS, "REVOKED")
    gap = Waiting()
    with pytest.raises(PdError) as e:
        asyncio.run(gap.wait_for(act=lambda: gap.lost("test gap")))
    assert (e.value.code, e.value.reason) == (grpc.StatusCode.UNAVAILABLE, "NOTICE_LOST")


def test_a_notice_of_another_prompt_under_these_leases_is_refused():
    """A replayed or hostile Prefill that won BeginWrite writes its own prompt with matching tags and checksums: only
    the digest differs (the formal model's notice_without_prompt)."""
    other = prompt_digest([5, 6, 8])
    assert other != DIGEST and prompt_digest([5, 6, 7]) == DIGEST
    with pytest.raises(PdError) as e:
        asyncio.run(Waiting().wait_for(_notice([(4, 9), (5, 9), (6, 9)], digest=other)))
    assert (e.value.code, e.value.reason) == (grpc.StatusCode.DATA_LOSS, "PROMPT_MISMATCH")
