"""Where a prompt's prefix most likely is: per role, a bounded LRU map from (scope, the first k full pages of a
prompt) to the backend that was last sent a prompt starting with them (issue 20).

A routing hint only, never a proof: decode and the broker check every cached page by its own chain. So the keys
here are the gateway's own (a running BLAKE2b over the scope and the page's tokens, with no checkpoint identity,
which the gateway does not know), and a stale entry costs a miss, nothing else.

Keys are taken at k = 1..16 pages, then 8 per doubling (k = 18, 20, ..., 32, 36, ...), and at the prompt's last full
page: a 1M-token prompt adds ~100 entries and ~4 MiB of hashing, not 65,536 entries that would flush every other
prefix; a match is then at most 1/8 shorter than the prefix a backend holds. Full pages are those before the page
of the last prompt token ((n - 1) // page_size), the pages decode caches.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

import numpy as np

DENSE_PAGES = 16  # every page up to here; then 8 keys per doubling


def checkpoints(num_pages: int) -> list[int]:
    out, n = [], 1
    while n <= num_pages:
        out.append(n)
        n += 1 if n < DENSE_PAGES else 1 << (n.bit_length() - 4)
    if out and out[-1] != num_pages:
        out.append(num_pages)
    return out


def route_keys(scope: bytes, token_ids: Sequence[int], page_size: int) -> list[tuple[int, bytes]]:
    """(pages, key) for each checkpoint of the prompt's full pages, shortest first; [] for none (a prompt of one
    page, or no scope: the cache is off and nothing is worth remembering)."""
    num_pages = (len(token_ids) - 1) // page_size if scope else 0
    if num_pages <= 0:
        return []
    # fromiter with a count: no copy of a long prompt's list before its conversion
    raw = memoryview(np.fromiter(token_ids, dtype="<i4", count=num_pages * page_size).tobytes())
    step = page_size * 4
    h = hashlib.blake2b(digest_size=16, person=b"pdserve-route-v1")
    h.update(len(scope).to_bytes(4, "little") + scope + page_size.to_bytes(4, "little"))
    out, done = [], 0
    for k in checkpoints(num_pages):
        h.update(raw[done * step:k * step])  # pages are of one size: the concatenation has one reading
        done = k
        out.append((k, h.copy().digest()))
    return out


class PrefixMap:
    """key -> backend target, least recently used forgotten first. One owner: the role's Router."""

    def __init__(self, max_entries: int = 1 << 16):
        if max_entries < 1:
            raise ValueError(f"a prefix map needs room for at least 1 entry, got {max_entries}")
        self.max_entries = max_entries
        self._lru: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def longest(self, keys: list[tuple[int, bytes]], eligible) -> tuple[int, str] | None:
        """(pages, target) of the longest remembered prefix whose backend is in eligible (targets), or None."""
        for k, key in reversed(keys):
            target = self._lru.get(key)
            if target is not None and target in eligible:
                return k, target
        return None

    def record(self, keys: list[tuple[int, bytes]], target: str) -> None:
        for _, key in keys:
            self._lru[key] = target
            self._lru.move_to_end(key)
        while len(self._lru) > self.max_entries:
            self._lru.popitem(last=False)
