"""Decode.Run's two waits, on the short critical path (issue 12), as objects the servicer composes.

GrantQueue: while the pool is full, Run calls wait for pages in a bounded queue, in order, woken when pages may
have been freed (never polled from the gateway). Notices: once the destination is sent, a Run waits for the
broker's write-done notice of its leases on the revocation stream. The notice stands for Validate at the instant
of prefill's successful EndWrite (leases current, that writer the active one, the generation sealed so nothing
can write it again), and the stream is ordered, so a later revocation reaches decode after it like any other.
Decode then verifies the prompt pages against the notice (tags, token counts, checksums) and streams the tokens,
the first one from the notice."""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Awaitable, Callable

import grpc

from ..common.config import pages_for
from ..common.deadline import deadline_exceeded
from ..common.drain import draining_error
from ..common.errors import PdError
from ..common.metrics import OVERLOAD_REJECTIONS, QUEUE_SECONDS, TIMEOUTS, count_violation
from .allocations import Allocation

log = logging.getLogger(__name__)


class GrantQueue:
    def __init__(self, queue_limit: int = 256, queue_timeout_s: float = 30.0,
                 is_draining: Callable[[], bool] = lambda: False):
        self.queue_limit, self.queue_timeout_s, self.is_draining = queue_limit, queue_timeout_s, is_draining
        self._queue: collections.deque = collections.deque()  # Run calls waiting for pages, oldest first
        self._changed = asyncio.Event()
        self._granted_at: collections.deque = collections.deque(maxlen=512)  # when queued requests got pages

    def __len__(self) -> int:
        return len(self._queue)

    def retry_after_s(self) -> float:
        """How long until the requests queued now have pages, at the rate requests got them over the last 10 s
        (the queue timeout when none did): the retry delay of a refusal."""
        now = time.monotonic()
        recent = sum(1 for t in self._granted_at if now - t <= 10.0)
        if not recent:
            return self.queue_timeout_s
        return min(60.0, max(0.05, (len(self._queue) + 1) / (recent / 10.0)))

    def pages_may_be_free(self) -> None:
        """Wakes the queue: decode released pages, or the broker's stream spoke (its sweeper frees quarantined
        pages and wakes the stream; heartbeats cover the rest), or draining began."""
        if self._queue:
            event, self._changed = self._changed, asyncio.Event()
            event.set()

    async def granted(self, grant: Callable[[], Awaitable[Allocation]], need: int, pool_id: str,
                      deadline: float | None) -> Allocation:
        """An allocation from grant(), after waiting in order while the pool has too few free pages."""
        arrived = time.monotonic()
        alloc = await self._queued_grant(grant, need, pool_id, deadline)
        QUEUE_SECONDS.labels("decode").observe(time.monotonic() - arrived)
        return alloc

    async def _queued_grant(self, grant: Callable[[], Awaitable[Allocation]], need: int, pool_id: str,
                            deadline: float | None) -> Allocation:
        if not self._queue:  # nobody waits: Grants go out side by side, as many as arrive
            try:
                return await grant()
            except PdError as e:
                if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
        # short of pages: queue behind whoever already waits (even one whose retry is in flight), oldest first
        if len(self._queue) >= self.queue_limit:
            OVERLOAD_REJECTIONS.labels("decode", "allocation_queue").inc()
            raise PdError(grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED",
                          f"{len(self._queue)} requests already wait for KV pages of pool {pool_id} (limit "
                          f"{self.queue_limit})", self.retry_after_s())
        me = object()
        self._queue.append(me)
        end = time.monotonic() + self.queue_timeout_s
        try:
            while True:
                changed = self._changed
                if self.is_draining():
                    raise draining_error("decode", f"pool {pool_id} takes no new allocation; {need} pages were "
                                                   "awaited")
                if self._queue[0] is me:
                    try:
                        alloc = await grant()
                        self._granted_at.append(time.monotonic())
                        return alloc
                    except PdError as e:
                        if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                            raise
                left = end if deadline is None else min(end, deadline)
                try:
                    await asyncio.wait_for(changed.wait(), max(0.0, left - time.monotonic()))
                except asyncio.TimeoutError:
                    TIMEOUTS.labels("queue").inc()
                    if deadline is not None and left == deadline:
                        raise deadline_exceeded(deadline, f"waiting for {need} KV pages") from None
                    raise PdError(grpc.StatusCode.RESOURCE_EXHAUSTED, "QUEUE_TIMEOUT",
                                  f"no {need} KV pages of pool {pool_id} freed within "
                                  f"{self.queue_timeout_s:.0f}s", self.retry_after_s()) from None
        finally:
            head = self._queue[0] is me
            self._queue.remove(me)
            if head:
                self.pages_may_be_free()  # the next in line may fit in what is left


class Notices:
    def __init__(self, page_size: int, blind: Callable[[], PdError | None]):
        self.page_size, self.blind = page_size, blind
        self._waiting: dict[bytes, asyncio.Future] = {}  # owner -> its write-done notice, while a Run waits

    def expect(self, owner: bytes) -> asyncio.Future:
        fut = self._waiting[owner] = asyncio.get_running_loop().create_future()
        return fut

    def forget(self, owner: bytes) -> None:
        self._waiting.pop(owner, None)

    def on_notice(self, msg) -> None:
        if (fut := self._waiting.get(msg.owner)) is not None and not fut.done():
            fut.set_result(msg)

    def lost(self, why: str) -> None:
        """The stream lost events: a waiting Run may never get its notice, so it ends (retryable, nothing sent)."""
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(PdError(grpc.StatusCode.UNAVAILABLE, "NOTICE_LOST", why))

    async def wait(self, owner: bytes, alloc: Allocation, fut: asyncio.Future, deadline: float | None,
                   digest: bytes, allocation_timeout_s: float):
        """The write-done notice, or an error once the allocation ends (with the reason it ended for), decode goes
        blind or time runs out."""
        end = alloc.deadline if deadline is None else min(alloc.deadline, deadline)
        while not fut.done():
            if alloc.ended is not None:
                raise alloc.ended
            if (err := self.blind()) is not None:  # a notice cannot reach a decode that hears nothing
                raise err
            left = end - time.monotonic()
            if left <= 0:
                TIMEOUTS.labels("allocation").inc()
                if deadline is not None and end == deadline:
                    raise deadline_exceeded(deadline, "while decode waited for prefill's write")
                raise PdError(grpc.StatusCode.DEADLINE_EXCEEDED, "NO_WRITE",
                              f"no write-done notice for {owner.hex()} within {allocation_timeout_s:.0f}s")
            # whoever ends the allocation does not touch fut: look again at least every 0.1 s
            await asyncio.wait({fut}, timeout=min(left, 0.1))
        notice = fut.result()
        # the notice must cover every prompt page: one it leaves out may still have this writer active on it
        n = pages_for(alloc.num_prompt_tokens, self.page_size)
        named = [(x.page, x.generation) for x in notice.leases]
        if notice.epoch != alloc.epoch or named != alloc.leases[alloc.num_shared:n]:
            count_violation("decode", "NOTICE_MISMATCH", owner)
            raise PdError(grpc.StatusCode.DATA_LOSS, "NOTICE_MISMATCH",
                          f"the write-done notice of {owner.hex()} names {len(named)} leases of epoch "
                          f"{notice.epoch:#x}; the {n - alloc.num_shared} prompt pages prefill writes are "
                          f"{alloc.leases[alloc.num_shared:n]} of epoch {alloc.epoch:#x}")
        if notice.prompt_digest != digest:
            # the leases were written with another prompt's KV (a replayed or hostile Prefill won BeginWrite):
            # tags and checksums are the writer's own and match; only the digest tells (found by the formal model)
            count_violation("decode", "PROMPT_MISMATCH", owner)
            raise PdError(grpc.StatusCode.DATA_LOSS, "PROMPT_MISMATCH",
                          f"the write-done notice of {owner.hex()} is for prompt digest {notice.prompt_digest.hex()}; "
                          f"this request's prompt has digest {digest.hex()}")
        return notice
