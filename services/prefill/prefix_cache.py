"""Prefill's own prefix cache: chain key -> a page of the local pool holding that prefix page's KV, so a prompt
whose prefix this prefill computed before (under the same scope: the key is pdserve.common.prefix's chain) skips
the forward pass over it. Plain Python over the PageAllocator, a part of LocalPages (local_pages.py), which alone
calls it in service and decides which pages enter it.

- A page enters only from a prompt whose write succeeded (a failed write's pages, which a late task may still read,
  never do), is never written while cached (a prompt that sends it copies it into a page of its own first), and is
  pinned while it is the context of a planned or running prompt.
- Unpinned pages are evicted least recently used when the allocator is short, before a prompt waits. A prompt's
  pages are touched last page first, so a chain loses its tail before its head (a head serves every prompt that a
  tail does, and more).
- The CRC-32C of each page is recorded when it is cached and re-checked when a prompt reuses it: a page whose bytes
  changed is a miss (it and every page after it in that prompt's hit are recomputed), counted, and leaves the cache.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from ..common.metrics import PREFIX_CACHED_PAGES, PREFIX_CORRUPT_PAGES, PREFIX_HIT_PAGES, PREFIX_MISS_PAGES
from ..engine.page_allocator import PageAllocator

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Entry:
    key: bytes
    checksum: int
    pins: int = 0


class PrefixCache:
    def __init__(self, alloc: PageAllocator, checksums: Callable[[list[int]], list[int]],
                 max_pages: int | None = None):
        """checksums(pages): the CRC-32C of each page's bytes now. max_pages: at most this many cached pages
        (None: as many as the pool's free pages allow; 0: no cache)."""
        if max_pages is not None and max_pages < 0:
            raise ValueError(f"max_pages must be >= 0 or None, got {max_pages}")
        self.alloc = alloc
        self.checksums = checksums
        self.max_pages = max_pages
        self._index: dict[bytes, int] = {}  # chain key -> page
        self._entries: dict[int, _Entry] = {}  # page -> what it holds, for every cached page
        self._idle: OrderedDict[int, None] = OrderedDict()  # unpinned cached pages, least recently used first
        self._doomed: dict[int, int] = {}  # pages taken out while pinned (bad bytes): freed at their last unpin
        self._publish()

    @property
    def enabled(self) -> bool:
        return self.max_pages != 0

    @property
    def num_cached(self) -> int:
        return len(self._entries)

    @property
    def num_idle(self) -> int:
        """Cached pages no prompt uses now: the allocator gets them back whenever it is short."""
        return len(self._idle)

    def match(self, chains: Sequence[bytes]) -> list[int]:
        """The pages of the longest run of chains, from the first, that is cached (nothing pinned, nothing
        checked: what acquire would start from)."""
        pages = []
        for key in chains:
            page = self._index.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, chains: Sequence[bytes]) -> list[int]:
        """Pins and returns the pages of the longest cached run of chains whose bytes still have their recorded
        checksums; counts the chains as hit or missed pages. The first page found changed leaves the cache, and
        it and every page after it are misses: the prompt recomputes them."""
        pages = self.match(chains)
        if pages:
            for i, (page, crc) in enumerate(zip(pages, self.checksums(pages))):
                entry = self._entries[page]
                if crc != entry.checksum:
                    PREFIX_CORRUPT_PAGES.inc()
                    log.warning("prefix cache: local page %d (prefix page %d) has CRC-32C %#010x, cached as "
                                "%#010x: dropped with the %d pages after it in this prompt's hit, recomputed",
                                page, i, crc, entry.checksum, len(pages) - i - 1)
                    self._drop(page)
                    pages = pages[:i]
                    break
            for page in reversed(pages):  # last page first: the head stays the most recently used
                self._pin(page)
        PREFIX_HIT_PAGES.inc(len(pages))
        PREFIX_MISS_PAGES.inc(len(chains) - len(pages))
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Unpins pages acquire returned (once each); a page taken out meanwhile is freed at its last unpin."""
        for page in reversed(pages):
            if page in self._doomed:
                self._doomed[page] -= 1
                if not self._doomed[page]:
                    del self._doomed[page]
                    self.alloc.deallocate([page])
                continue
            entry = self._entries.get(page)
            if entry is None or entry.pins <= 0:
                raise ValueError(f"page {page} released but not pinned in the prefix cache")
            entry.pins -= 1
            if not entry.pins:
                self._idle[page] = None

    def can_allocate(self, n: int, keep: Sequence[int] = ()) -> bool:
        """Whether allocate(n) would succeed once the pages in keep (a match about to be acquired) are pinned."""
        evictable = len(self._idle) - sum(page in self._idle for page in keep)
        return 0 < n <= self.alloc.num_free + evictable

    def allocate(self, n: int) -> list[int]:
        """n pages from the allocator, evicting unpinned cached pages (least recently used first) while short."""
        while self.alloc.num_free < n and self._idle:
            self._evict()
        return self.alloc.allocate(n)

    def insert(self, chains: Sequence[bytes], pages: Sequence[int], checksums: Sequence[int]) -> int:
        """Takes over pages (a successful write's full prompt pages, chains[i] the key of pages[i], checksums[i]
        the CRC-32C of its bytes as they were computed): each is cached, or freed when its key is cached already
        or the cache is at max_pages with nothing unpinned to evict. Returns how many were cached."""
        if not (len(chains) == len(pages) == len(checksums)):
            raise ValueError(f"{len(chains)} chain keys, {len(pages)} pages, {len(checksums)} checksums")
        cached, spare = [], []
        for key, page, crc in zip(chains, pages, checksums):
            if not self.enabled or key in self._index:
                spare.append(page)
                continue
            if self.max_pages is not None and len(self._entries) >= self.max_pages:
                if not self._idle:
                    spare.append(page)
                    continue
                self._evict()
            self._index[key] = page
            self._entries[page] = _Entry(key, crc)
            cached.append(page)
        for page in reversed(cached):
            self._idle[page] = None
        if spare:
            self.alloc.deallocate(spare)
        self._publish()
        return len(cached)

    def _pin(self, page: int) -> None:
        entry = self._entries[page]
        entry.pins += 1
        self._idle.pop(page, None)

    def _evict(self) -> None:
        page, _ = self._idle.popitem(last=False)
        entry = self._entries.pop(page)
        del self._index[entry.key]
        self.alloc.deallocate([page])
        self._publish()

    def _drop(self, page: int) -> None:
        """Takes a page out of the cache: no later prompt finds it; freed now, or at its last unpin."""
        entry = self._entries.pop(page)
        del self._index[entry.key]
        if entry.pins:
            self._doomed[page] = entry.pins
        else:
            del self._idle[page]
            self.alloc.deallocate([page])
        self._publish()

    def _publish(self) -> None:
        PREFIX_CACHED_PAGES.set(len(self._entries))
