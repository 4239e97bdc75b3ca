"""One pool's cached prefix pages (docs/design.md §8): the chain index, the unread pages in least-recently-used order,
and the pinned ones. Bookkeeping only: LeaseTable makes every transition and keeps this in step with the pages.

A cached page is in `cached` from Publish until it is evicted or quarantined. It is indexed (found by Grants)
until it is evicted or Unpublished; it is unread when no owner reads it and no revoked reader's step may still
read it, and only an unread, indexed page is in the LRU, the one place eviction takes pages from."""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable


class PrefixCache:
    def __init__(self) -> None:
        self.index: dict[bytes, int] = {}  # chain key -> page
        self.lru: OrderedDict[int, None] = OrderedDict()  # unread indexed pages, least recently read first
        self.pinned: set[int] = set()  # cached pages that revoked readers' holders still pin
        self.cached: set[int] = set()
        # reader shares summed over the cached pages, kept as they change: pool_state runs after every call, and
        # a pool at the incident's scale caches ~10^5 pages
        self.num_reads = 0

    def find(self, chain: bytes) -> int | None:
        return self.index.get(chain)

    def is_indexed(self, page_id: int, chain: bytes) -> bool:
        return self.index.get(chain) == page_id

    def add(self, page_id: int, chain: bytes) -> None:
        self.index[chain] = page_id
        self.cached.add(page_id)

    def unindex(self, page_id: int, chain: bytes) -> None:
        """No later Grant finds the page; it leaves once unread."""
        if self.index.get(chain) == page_id:
            del self.index[chain]
        self.lru.pop(page_id, None)

    def mark_read(self, page_id: int) -> None:
        self.lru.pop(page_id, None)

    def mark_unread(self, page_id: int) -> None:
        self.lru[page_id] = None
        self.lru.move_to_end(page_id)

    def num_evictable(self, keep: Iterable[int] = ()) -> int:
        return len(self.lru) - sum(1 for page_id in set(keep) if page_id in self.lru)

    def victims(self, num: int, keep: Iterable[int] = ()) -> list[int]:
        """The num least recently read unread pages not in keep (the caller checked there are as many)."""
        keep = set(keep)
        out = []
        for page_id in self.lru:
            if len(out) == num:
                break
            if page_id not in keep:
                out.append(page_id)
        return out

    def drop(self, page_id: int, chain: bytes) -> None:
        """The page is cached no more (evicted, or on its way through quarantine)."""
        self.unindex(page_id, chain)
        self.pinned.discard(page_id)
        self.cached.discard(page_id)

