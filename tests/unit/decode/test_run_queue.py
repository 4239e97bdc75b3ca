"""Decode.Run's allocation queue (run.py) against a fake grant: requests wait in arrival order while the pool is
short, are woken by freed pages rather than polling, and the queue is bounded in length and time."""
import asyncio
import time

import grpc
import pytest

from pdserve.common.errors import PdError
from pdserve.decode.run import RunStream


class Pool(RunStream):
    """RunStream with a pool of `free` pages; grant() takes them or raises RESOURCE_EXHAUSTED like the broker."""

    def __init__(self, free: int, limit: int = 8, timeout_s: float = 5.0):
        self.init_run(limit, timeout_s)
        self.free, self.pool_id, self.order, self.grants, self.draining = free, "p", [], 0, False

    def admit_allocation(self, owner, num_prompt, max_tokens):
        return num_prompt

    async def grant(self, owner, num_prompt, max_tokens, need, deadline):
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
        assert pool.grants <= 2  # one try on arrival (the first) and one as head: nothing polls while idle
        pool.give_back(2)
        await asyncio.sleep(0.05)
        assert pool.order == []  # 2 free pages do not fit the head; s1 waits behind it
        pool.give_back(4)
        await asyncio.gather(*tasks)
        assert pool.order == [b"big", b"s1", b"s2"] and pool.free == 0 and not pool._queue
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

