"""Pages on demand (an object the scheduler composes): a request is granted its prompt pages plus a small
headroom, and its lease grows as it generates, ahead of need and in batches, so no broker round trip sits on the
per-token path.

Before every step the scheduler hands its running sequences to `plan`. Once one's leased pages ahead of its
position fall below the headroom (and it may still need more: prompt + max_tokens is the most), an Extend call
goes out for it and for every sequence that would fall below within another headroom, asking for each
`growth_pages` or an eighth of what it holds, whichever is more (so a million-token sequence grows in a few
dozen calls, not tens of thousands). One call is in flight at a time; every sequence due
meanwhile goes into the next one. The broker leases growth pages to the sequence's own owner at a fresh generation,
so revocation, reconciliation and the tag checks cover them as they cover prompt pages; a step never writes a
page before its lease arrived (the scheduler skips a sequence without a leased page for its next position).

When the pool runs dry (POOL_EXHAUSTED) the policy is:
  1. new allocations wait (the grant queue) while any running sequence lacks a page for its next step that the
     broker refused for want of pages: running requests come first (one whose Extend is only on its way holds
     back no one);
  2. a sequence that has lacked that page for `preempt_after_s` (a quarantine or a release may free pages sooner)
     preempts the youngest running request (the last admitted; possibly itself) of those the gateway resubmitted
     the fewest times (a resubmission is admitted anew, so by age alone the request just handed back would be the
     next victim again, until its resubmissions run out): that request's stream ends with
     UNAVAILABLE / PREEMPTED carrying how many tokens it streamed (`tokens_streamed`), its pages are released, and
     the gateway resubmits prompt + those tokens through prefill and continues the client's stream;
  3. one preemption at a time: the next no sooner than `preempt_after_s` after the last, so the pages released
     reach the broker and the starving sequences' next Extend before anyone else is preempted.
Every preemption is counted (pdserve_preemptions_total). No page is ever read or written without a current lease.
"""
from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable, Iterable

import grpc

from ..common.errors import PdError
from ..common.metrics import GROWTH_PAGES, PREEMPTIONS, count_violation
from ..common.tasks import spawn
from .sequence import Sequence

log = logging.getLogger(__name__)

Lease = tuple[int, int]
RETRY_S = 0.1  # a refused (pool dry) or failed Extend is asked again no sooner than this
# one Extend call: [(owner, pages)] -> per item its leases or the refusal (a PdError with the broker's reason)
ExtendCall = Callable[[list[tuple[bytes, int]]], Awaitable[list["list[Lease] | PdError"]]]


def preempted(seq: Sequence, why: str) -> PdError:
    """The retryable error a preempted request ends with; `tokens_streamed` lets the gateway resubmit prompt + those
    tokens and check that it continues the stream without a gap."""
    return PdError(grpc.StatusCode.UNAVAILABLE, "PREEMPTED",
                   f"request {seq.owner.hex()} was preempted after {len(seq.generated)} tokens: {why}",
                   metadata={"tokens_streamed": str(len(seq.generated))})


class Growth:
    def __init__(self, extend: ExtendCall, page_size: int, headroom_pages: int = 2, growth_pages: int = 8,
                 preempt_after_s: float = 0.5, wake: Callable[[], None] = lambda: None,
                 mark: Callable[[Sequence, PdError], None] = lambda s, e: None, on_broker_moved=lambda: None,
                 clock: Callable[[], float] = time.monotonic):
        if headroom_pages < 1 or growth_pages < 1:
            raise ValueError(f"headroom_pages {headroom_pages} and growth_pages {growth_pages} must be >= 1")
        self.extend, self.page_size = extend, page_size
        self.headroom_pages, self.growth_pages, self.preempt_after_s = headroom_pages, growth_pages, preempt_after_s
        # mark: ends a sequence between steps (a step in flight may still write its pages now)
        self.wake, self.mark, self.on_broker_moved, self.clock = wake, mark, on_broker_moved, clock
        self.in_flight = False
        self.starving: dict[bytes, float] = {}  # owner -> since when its next step has no leased page
        self._exhausted: dict[bytes, float] = {}  # owner -> when the broker last said POOL_EXHAUSTED for it
        self._preempted_at = float("-inf")
        self._retry_at = 0.0  # after a failed call

    def forget(self, owner: bytes) -> None:
        """The sequence ended (the scheduler calls this): it waits for nothing any more."""
        self.starving.pop(owner, None)
        self._exhausted.pop(owner, None)

    def blocks_new_grants(self) -> bool:
        """Whether new allocations must wait: a running sequence needs a page the pool could not give (the broker
        said POOL_EXHAUSTED for it). One that only outran its headroom while its Extend is on the way (a slow
        broker, a loaded machine) holds back no one: refusing then turned new requests away as RUNNING_FIRST on a
        pool with pages to spare."""
        return any(o in self._exhausted for o in self.starving)

    def ahead(self, seq: Sequence) -> int:
        """Leased pages after the one the next step writes."""
        return len(seq.leases) - seq.position // self.page_size - 1

    def plan(self, running: Iterable[Sequence]) -> None:
        """Called by the scheduler between steps: sends one Extend for every sequence due, when none is in flight,
        and applies the preemption policy."""
        now = self.clock()
        seqs = [s for s in running if not s.done and not s.cancelled]
        live = {s.owner for s in seqs}
        self._exhausted = {o: f for o, f in self._exhausted.items() if o in live}
        self.starving = {s.owner: self.starving.get(s.owner, now) for s in seqs
                         if not s.has_page_for_next_step(self.page_size)}
        self._preempt_if_dry(seqs, now)
        if self.in_flight or now < self._retry_at:
            return
        growing = [s for s in seqs if s.max_pages > len(s.leases)
                   and now - self._exhausted.get(s.owner, float("-inf")) >= RETRY_S]
        due = [s for s in growing if self.ahead(s) < self.headroom_pages]
        if due:  # whoever would be due within another headroom rides along: one call instead of several
            due = [(s, self._want(s)) for s in growing if self.ahead(s) < 2 * self.headroom_pages]
        if due:
            self.in_flight = True
            spawn(self._grow(due))

    def _want(self, seq: Sequence) -> int:
        return min(seq.max_pages - len(seq.leases), max(self.growth_pages, len(seq.leases) // 8))

    async def _grow(self, due: list[tuple[Sequence, int]]) -> None:
        try:
            results = await self.extend([(s.owner, n) for s, n in due])
        except PdError as e:
            if e.reason in ("EPOCH_MISMATCH", "UNKNOWN_POOL", "POOL_FENCED"):
                self.on_broker_moved()  # the move fails every running sequence; nothing to grow here
            log.warning("broker Extend for %d sequences failed: %s; retrying in %gs", len(due), e, RETRY_S)
            self._retry_at = self.clock() + RETRY_S
            return
        finally:
            self.in_flight = False
            self.wake()
        for (seq, n), result in zip(due, results):
            if not isinstance(result, PdError):
                self._exhausted.pop(seq.owner, None)
                if not (seq.done or seq.cancelled):  # else its Release (by owner) ends these pages too
                    seq.grow(result)
                    GROWTH_PAGES.inc(len(result))
            elif result.reason == "POOL_EXHAUSTED":
                self._exhausted[seq.owner] = self.clock()
            elif result.reason == "OWNER_NOT_LEASED" and not seq.done:
                # decode did not release it, so the broker ended its leases (a revocation, whose notice may still
                # be on its way, or come once the request has ended): it ends as revoked, with no further token,
                # counted once whichever tells decode first
                if seq.first_revocation():
                    count_violation("decode", "REVOKED", seq.owner)
                self.mark(seq, PdError(grpc.StatusCode.DATA_LOSS, "REVOKED",
                                       f"the broker holds no leases of {seq.owner.hex()} any more (revoked): "
                                       f"{n} growth pages refused: {result.message}"))
            elif not seq.done:
                # refused outright: any doubt about who owns the pages ends the request, never with output
                count_violation("decode", "GROWTH_REFUSED", seq.owner)
                self.mark(seq, PdError(grpc.StatusCode.DATA_LOSS, "GROWTH_REFUSED",
                                       f"the broker refused {n} growth pages for {seq.owner.hex()}: {result.reason}: "
                                       f"{result.message}"))

    def _preempt_if_dry(self, seqs: list[Sequence], now: float) -> None:
        waited = [o for o, since in self.starving.items() if now - since >= self.preempt_after_s
                  and o in self._exhausted]
        if not waited or now - self._preempted_at < self.preempt_after_s:
            return
        victim = max(seqs, key=lambda s: (-s.handed_back, s.admitted))
        PREEMPTIONS.inc()
        self._preempted_at = now
        log.warning("pool dry: %d sequences lack a page for their next step (oldest for %.2fs); preempting the "
                    "youngest of those handed back the fewest times (%d), %s, after %d tokens (%d pages)",
                    len(self.starving), now - min(self.starving.values()), victim.handed_back, victim.owner.hex(),
                    len(victim.generated), len(victim.leases))
        self.starving.pop(victim.owner, None)
        self.mark(victim, preempted(victim, f"the KV pool ran dry and {len(waited)} older requests waited "
                                           f"{self.preempt_after_s:g}s for pages; resubmit prompt + its tokens"))
