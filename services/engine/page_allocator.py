"""Local page bookkeeping (prefill's own pool): plain Python, lowest page first so runs stay contiguous."""
from __future__ import annotations

import heapq


class PageAllocator:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 < n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise MemoryError(f"{n} pages requested, {len(self._free)} of {self.num_pages} free")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(pages)
        return pages

    def deallocate(self, pages: list[int]) -> None:
        bad = [p for p in pages if p not in self._used]
        if bad or len(set(pages)) != len(pages):
            # checked before any change, so a refused call leaves the allocator as it was
            which = ", ".join(f"page {p}" for p in (bad or pages))
            raise ValueError(f"{which}: freed twice or never allocated")
        for p in pages:
            self._used.remove(p)
            heapq.heappush(self._free, p)
