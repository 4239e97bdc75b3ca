"""Decode.Run: Allocate and Decode in one stream, on the short critical path (issue 12).

The stream grants pages (queueing, bounded and in order, while the pool is full: woken when pages may have been
freed, never polling from the gateway), sends the destination, then waits for the broker's write-done notice
of those leases on the revocation stream. The notice stands for Validate at the instant of prefill's successful
EndWrite (leases current, that writer the active one, the generation sealed so nothing can write it again), and
the stream is ordered, so a later revocation reaches decode after it like any other. Decode then verifies the
prompt pages against the notice (tags, token counts, checksums) and streams the tokens, the first one from the
notice. A mixin of DecodeServicer."""
from __future__ import annotations

import asyncio
import collections
import logging
import time

import grpc

from ..common.deadline import deadline_of, deadline_exceeded
from ..common.drain import draining_error
from ..common.errors import PdError, invalid
from ..common.config import pages_for
from ..common.metrics import LEASE_VIOLATIONS, OVERLOAD_REJECTIONS, TIMEOUTS
from ..common.proto import decode_pb2

log = logging.getLogger(__name__)


class RunStream:
    def init_run(self, queue_limit: int = 256, queue_timeout_s: float = 30.0) -> None:
        self.queue_limit, self.queue_timeout_s = queue_limit, queue_timeout_s
        self.notices: dict[bytes, asyncio.Future] = {}  # owner -> its write-done notice, while a Run waits for it
        self._queue: collections.deque = collections.deque()  # Run calls waiting for pages, oldest first
        self._changed = asyncio.Event()
        self._granted_at: collections.deque = collections.deque(maxlen=512)  # when queued requests got pages

    def retry_after_s(self) -> float:
        """How long until the requests queued now have pages, at the rate requests got them over the last 10 s
        (the queue timeout when none did): the retry delay of a refusal."""
        now = time.monotonic()
        recent = sum(1 for t in self._granted_at if now - t <= 10.0)
        if not recent:
            return self.queue_timeout_s
        return min(60.0, max(0.05, (len(self._queue) + 1) / (recent / 10.0)))

    def pages_may_be_free(self) -> None:  # also called when draining begins: the waiters are refused
        """Wakes the allocation queue: this decode released pages, or the broker's stream spoke (its sweeper
        frees quarantined pages and wakes the stream; heartbeats cover the rest)."""
        if self._queue:
            event, self._changed = self._changed, asyncio.Event()
            event.set()

    def on_notice(self, msg) -> None:
        if (fut := self.notices.get(msg.owner)) is not None and not fut.done():
            fut.set_result(msg)

    def notices_lost(self, why: str) -> None:
        """The stream lost events: a waiting Run may never get its notice, so it ends (retryable, nothing sent)."""
        for fut in self.notices.values():
            if not fut.done():
                fut.set_exception(PdError(grpc.StatusCode.UNAVAILABLE, "NOTICE_LOST", why))

    async def Run(self, request, context):
        owner, deadline = request.request_id, deadline_of(context)
        sampling = request.sampling
        if len(request.prompt_digest) != 16:
            raise invalid("BAD_PROMPT_DIGEST", f"prompt_digest must be 16 bytes, got {len(request.prompt_digest)}")
        alloc = await self._granted(owner, request.num_prompt_tokens, sampling.max_tokens, deadline)
        fut = self.notices[owner] = asyncio.get_running_loop().create_future()
        taken = False
        try:
            yield decode_pb2.RunEvent(destination=self.destination(alloc))
            notice = await self._notice(owner, alloc, fut, deadline, request.prompt_digest)
            if self.allocations.get(owner) is not alloc:
                raise self._gone(owner, alloc)
            del self.allocations[owner]
            taken = True
            dreq = decode_pb2.DecodeRequest(request_id=owner, num_prompt_tokens=request.num_prompt_tokens,
                                            first_token=notice.first_token, sampling=sampling,
                                            coverage=notice.coverage, prompt_token_ids=request.prompt_token_ids)
            async for r in self.decode_stream(dreq, alloc, deadline, validate=False):
                yield decode_pb2.RunEvent(token=r)
        finally:
            self.notices.pop(owner, None)
            if not taken and self.allocations.get(owner) is alloc:  # never reached decoding: give the pages back
                del self.allocations[owner]
                await asyncio.shield(self._release(owner, alloc.epoch, alloc.leases))

    def _gone(self, owner: bytes, alloc) -> PdError:
        if alloc.epoch != self.epoch or alloc.pool_id != self.pool_id:
            return PdError(grpc.StatusCode.UNAVAILABLE, "BROKER_RESTARTED",
                           f"leases of pool {alloc.pool_id} epoch {alloc.epoch:#x} ended with the move to pool "
                           f"{self.pool_id} epoch {self.epoch:#x}")
        return PdError(grpc.StatusCode.DATA_LOSS, "REVOKED", f"request {owner.hex()}'s allocation ended (revoked, "
                                                             "released or expired) before its KV was written")

    async def _notice(self, owner: bytes, alloc, fut: asyncio.Future, deadline: float | None, digest: bytes):
        """The write-done notice, or an error once the allocation ends, the broker moves or time runs out."""
        end = alloc.deadline if deadline is None else min(alloc.deadline, deadline)
        while not fut.done():
            if self.allocations.get(owner) is not alloc or alloc.epoch != self.epoch:
                raise self._gone(owner, alloc)
            if (err := self.blind_error()) is not None:  # a notice cannot reach a decode that hears nothing
                raise err
            left = end - time.monotonic()
            if left <= 0:
                TIMEOUTS.labels("allocation").inc()
                if deadline is not None and end == deadline:
                    raise deadline_exceeded(deadline, "while decode waited for prefill's write")
                raise PdError(grpc.StatusCode.DEADLINE_EXCEEDED, "NO_WRITE",
                              f"no write-done notice for {owner.hex()} within {self.allocation_timeout_s:.0f}s")
            # the revocation handler ends the allocation without touching fut: look again at least every 0.1 s
            await asyncio.wait({fut}, timeout=min(left, 0.1))
        notice = fut.result()
        # the notice must cover every prompt page: one it leaves out may still have this writer active on it
        n = pages_for(alloc.num_prompt_tokens, self.pool.page_size)
        named = [(x.page, x.generation) for x in notice.leases]
        if notice.epoch != alloc.epoch or named != alloc.leases[:n]:
            LEASE_VIOLATIONS.labels("decode", "NOTICE_MISMATCH").inc()
            raise PdError(grpc.StatusCode.DATA_LOSS, "NOTICE_MISMATCH",
                          f"the write-done notice of {owner.hex()} names {len(named)} leases of epoch "
                          f"{notice.epoch:#x}; its {n} prompt pages are {alloc.leases[:n]} of epoch {alloc.epoch:#x}")
        if notice.prompt_digest != digest:
            # the leases were written with another prompt's KV (a replayed or hostile Prefill won BeginWrite):
            # tags and checksums are the writer's own and match; only the digest tells (found by the formal model)
            LEASE_VIOLATIONS.labels("decode", "PROMPT_MISMATCH").inc()
            raise PdError(grpc.StatusCode.DATA_LOSS, "PROMPT_MISMATCH",
                          f"the write-done notice of {owner.hex()} is for prompt digest {notice.prompt_digest.hex()}; "
                          f"this request's prompt has digest {digest.hex()}")
        return notice

    async def _granted(self, owner: bytes, num_prompt: int, max_tokens: int, deadline: float | None):
        """An allocation, after waiting in order while the pool has too few free pages."""
        need = self.admit_allocation(owner, num_prompt, max_tokens)
        if not self._queue:  # nobody waits: Grants go out side by side, as many as arrive
            try:
                return await self.grant(owner, num_prompt, max_tokens, need, deadline)
            except PdError as e:
                if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
        # short of pages: queue behind whoever already waits (even one whose retry is in flight), oldest first
        if len(self._queue) >= self.queue_limit:
            OVERLOAD_REJECTIONS.labels("decode", "allocation_queue").inc()
            raise PdError(grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED",
                          f"{len(self._queue)} requests already wait for KV pages of pool {self.pool_id} (limit "
                          f"{self.queue_limit})", self.retry_after_s())
        me = object()
        self._queue.append(me)
        end = time.monotonic() + self.queue_timeout_s
        try:
            while True:
                changed = self._changed
                if self.draining:
                    raise draining_error("decode", f"pool {self.pool_id} takes no new allocation; {need} pages were "
                                                   "awaited")
                if self._queue[0] is me:
                    try:
                        alloc = await self.grant(owner, num_prompt, max_tokens, need, deadline)
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
                                  f"no {need} KV pages of pool {self.pool_id} freed within "
                                  f"{self.queue_timeout_s:.0f}s", self.retry_after_s()) from None
        finally:
            head = self._queue[0] is me
            self._queue.remove(me)
            if head:
                self.pages_may_be_free()  # the next in line may fit in what is left
