"""Prefill's local KV pages: one owner of the pool's allocator and its prefix cache, touched only from the event loop.

Life cycle of a prompt's pages:
1. `reserve` (its first pass is planned): the longest cached prefix it may reuse, pinned and checked, then pages
   of its own for the rest and one more own page per cached page the destination lacks (the write sends a copy).
   None when they do not fit now: nothing is taken.
2. The forward pass writes its own pages after the hit; `worker.send` copies the hit's pages the destination lacks
   into the copies and writes only own pages. The worker reads a Reservation, never changes it.
3. It ends one of two ways:
   - `finish`: its hit unpinned, its own full pages cached when its write succeeded (given the write's CRC-32C),
     every other own page freed, all in this one call;
   - `hold_after_failed_write`: a write that posted and then failed (or ran past its timeout) may still be read by
     a transport task: its hit is unpinned at once (a write never reads a cached page), its own pages stay out of
     reuse, and out of the cache, until `release_held`, which refuses before the landing bound has passed from
     the hold (taken once the write's call returned, so after its every post).

The invariant, held by every method here and by nothing else touching the allocator or the cache: each page of
the pool is exactly one of free, cached (indexed, or dropped for bad bytes while still pinned), own to one live
reservation, or held for one failed write; a cached page is only ever read (pinned by live reservations), and a
held page is handed out again only once its landing bound has passed.
"""
from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..common.metrics import GUARD_SECONDS, SOURCE_PAGES_HELD
from ..engine.page_allocator import PageAllocator
from .prefix_cache import PrefixCache

log = logging.getLogger(__name__)


class State(enum.Enum):
    LIVE = "live"  # its pages are being computed or written
    HELD = "held"  # a failed write may still read its own pages
    ENDED = "ended"  # nothing of the pool is its any more


@dataclass(slots=True, eq=False)
class Reservation:
    """One prompt's local pages, in prompt order: the first `hit` are cached pages (pinned, read-only), the rest
    its own; `copies` are own pages that take the bytes of cached pages cached_pages..hit-1 for the write."""
    pages: list[int]
    hit: int = 0
    copies: list[int] = field(default_factory=list)
    chains: list[bytes] = field(default_factory=list)  # chain key of each full page ([] without a prefix scope)
    state: State = State.LIVE
    safe_at: float = 0.0  # held: when the failed write's last byte has landed, at the latest

    @property
    def own(self) -> list[int]:
        """The pages this reservation alone holds."""
        return self.pages[self.hit:] + self.copies


class LocalPages:
    def __init__(self, num_pages: int, checksums: Callable[[list[int]], list[int]],
                 max_cached_pages: int | None = None, clock: Callable[[], float] = time.monotonic):
        """checksums(pages): the CRC-32C of each page's bytes now. max_cached_pages: at most this many cached pages
        (None: as many as the pool's free pages allow; 0: no cache)."""
        self.alloc = PageAllocator(num_pages)  # its counts are read by tests and GetInfo; only this class changes it
        self.cache = PrefixCache(self.alloc, checksums, max_cached_pages)
        self.checksums = checksums
        self.clock = clock
        self._owner: dict[int, Reservation] = {}  # own page -> its live or held reservation
        self.num_held = 0

    @property
    def num_pages(self) -> int:
        return self.alloc.num_pages

    @property
    def caching(self) -> bool:
        return self.cache.enabled

    @property
    def num_available(self) -> int:
        """Pages a prompt could take now: free ones and cached ones nobody reads."""
        return self.alloc.num_free + self.cache.num_idle

    def num_matched(self, chains: Sequence[bytes]) -> int:
        """How many of chains, from the first, are cached now (nothing pinned, nothing checked)."""
        return len(self.cache.match(chains))

    def reserve(self, num_pages: int, chains: Sequence[bytes] = (), cached_pages: int = 0,
                reuse: int = 0) -> Reservation | None:
        """A prompt of num_pages pages (chains: its chain keys, cached_pages: the destination's) that may reuse up
        to its first `reuse` pages from the cache; None when its pages do not fit now."""
        chains = list(chains)
        reusable = chains[:reuse]
        matched = self.cache.match(reusable)
        if not self.cache.can_allocate(_own(num_pages, len(matched), cached_pages), keep=matched):
            return None
        with GUARD_SECONDS.labels("prefix_check").time():  # the CRC-32C re-check of the cached pages it reuses
            hit = self.cache.acquire(reusable) if reusable else []
        need = _own(num_pages, len(hit), cached_pages)
        if not self.cache.can_allocate(need):  # a page of the hit had changed: the longer recompute does not fit now
            self.cache.release(hit)
            return None
        own = self.cache.allocate(need)
        if taken := [p for p in own if p in self._owner]:
            raise RuntimeError(f"local pages {taken} handed out while a reservation holds them "
                               f"({len(self._owner)} pages owned, {self.num_held} held)")
        res = Reservation(hit + own[:num_pages - len(hit)], len(hit), own[num_pages - len(hit):], chains)
        for page in own:
            self._owner[page] = res
        return res

    def finish(self, res: Reservation, written: dict[int, int] | None = None) -> int:
        """Ends a live reservation. written: after a successful write, the CRC-32C of the prompt's pages by index as
        the write computed them (from before any fault could flip a byte; {} where it computed none): its own full
        pages enter the cache. None: nothing is cached. Returns how many pages were cached."""
        self._check(res, State.LIVE, "finished")
        self.cache.release(res.pages[:res.hit])
        own, num_cached = res.own, 0
        full = len(res.chains)
        if written is not None and self.cache.enabled and full > res.hit:
            crcs = dict(written)
            missing = [i for i in range(res.hit, full) if i not in crcs]
            if missing:
                crcs.update(zip(missing, self.checksums([res.pages[i] for i in missing])))
            cached = res.pages[res.hit:full]
            taken = set(cached)
            own = [p for p in own if p not in taken]
            self._disown(cached)
            num_cached = self.cache.insert(res.chains[res.hit:full], cached, [crcs[i] for i in range(res.hit, full)])
        self._disown(own)
        if own:
            self.alloc.deallocate(own)
        res.state = State.ENDED
        return num_cached

    def hold_after_failed_write(self, res: Reservation, landing_s: float) -> float:
        """A live reservation whose write posted and failed, its call returned now: its own pages stay out of reuse
        until landing_s from now. Returns that moment (res.safe_at)."""
        self._check(res, State.LIVE, "held")
        self.cache.release(res.pages[:res.hit])  # cached pages are context only: a write sends copies of them
        res.safe_at = self.clock() + landing_s
        res.state = State.HELD
        self.num_held += len(res.own)
        SOURCE_PAGES_HELD.inc(len(res.own))
        log.warning("holding %d source pages for %.3fs: a failed write may still read them", len(res.own), landing_s)
        return res.safe_at

    def release_held(self, res: Reservation) -> None:
        """Frees a held reservation's pages; refuses before its landing bound has passed."""
        self._check(res, State.HELD, "released")
        now = self.clock()
        if now < res.safe_at:
            raise RuntimeError(f"{len(res.own)} source pages of a failed write released {res.safe_at - now:.3f}s "
                               f"before its landing bound")
        own = res.own
        self._disown(own)
        if own:
            self.alloc.deallocate(own)
        self.num_held -= len(own)
        SOURCE_PAGES_HELD.dec(len(own))
        res.state = State.ENDED

    def _check(self, res: Reservation, want: State, verb: str) -> None:
        if res.state is not want or any(self._owner.get(p) is not res for p in res.own):
            raise ValueError(f"reservation of {len(res.pages)} pages ({res.hit} cached) is {res.state.value}, not "
                             f"{want.value}, or not this pool's: it cannot be {verb}")

    def _disown(self, pages: Sequence[int]) -> None:
        for page in pages:
            del self._owner[page]


def _own(num_pages: int, hit: int, cached_pages: int) -> int:
    """Own pages of a prompt with a hit of `hit` pages: the rest, and a copy of each cached page the destination
    lacks."""
    return num_pages - hit + max(0, hit - cached_pages)
