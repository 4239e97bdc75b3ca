"""Prefill's prefix cache over a PageAllocator, with fake page bytes (one checksum per page the test can change):
pins, least-recently-used eviction (a chain's tail before its head), the checksum re-check on reuse, duplicates,
the page limit, and the cache being off."""
import pytest
from prometheus_client import REGISTRY

from pdserve.engine.page_allocator import PageAllocator
from pdserve.prefill.prefix_cache import PrefixCache


class Bytes:
    """What each page holds now, as its checksum."""

    def __init__(self):
        self.crc: dict[int, int] = {}

    def __call__(self, pages):
        return [self.crc.get(p, 0) for p in pages]


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i:02d}".encode().ljust(16, b".") for i in range(n)]


def metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def cache_with(num_pages: int, max_pages=None):
    alloc, data = PageAllocator(num_pages), Bytes()
    return alloc, data, PrefixCache(alloc, data, max_pages)


def put(cache: PrefixCache, data: Bytes, chains: list[bytes]) -> list[int]:
    """A prompt that computed these pages and wrote them: its pages enter the cache."""
    pages = cache.allocate(len(chains))
    for p in pages:
        data.crc[p] = 1000 + p
    assert cache.insert(chains, pages, data(pages)) == len(chains)
    return pages


def test_a_hit_is_the_longest_cached_run_from_the_first_page_and_is_pinned_until_released():
    alloc, data, cache = cache_with(8)
    a = keys("a", 4)
    pages = put(cache, data, a[:3])
    assert cache.num_cached == 3 and alloc.num_free == 5
    assert cache.match(a) == pages  # the 4th key was never cached
    assert cache.match([a[0], keys("b", 1)[0], a[2]]) == pages[:1]  # a run, from the first: a gap ends it
    assert cache.match(keys("b", 3)) == []
    hit = cache.acquire(a[:2])
    assert hit == pages[:2] and cache.num_idle == 1
    # the pool is short: only the unpinned page goes, the pinned ones stay cached and findable
    assert not cache.can_allocate(7) and cache.can_allocate(6)
    got = cache.allocate(6)
    assert pages[2] in got and cache.match(a) == pages[:2]
    alloc.deallocate(got)
    cache.release(hit)
    assert cache.num_idle == 2 and cache.can_allocate(8)
    assert not cache.can_allocate(8, keep=hit)  # a match about to be pinned is not counted as evictable
    with pytest.raises(ValueError, match=f"page {pages[0]} released but not pinned"):
        cache.release(pages[:1])


def test_eviction_is_least_recently_used_and_takes_a_chain_tail_before_its_head():
    alloc, data, cache = cache_with(6)
    a, b = keys("a", 3), keys("b", 3)
    pa, pb = put(cache, data, a), put(cache, data, b)
    cache.release(cache.acquire(a[:2]))  # a's head is the most recently used now, then b (newer than a's tail)
    assert alloc.num_free == 0
    order = []
    for _ in range(6):
        got = cache.allocate(1)
        order += got
    assert order == [pa[2], pb[2], pb[1], pb[0], pa[1], pa[0]]
    assert cache.num_cached == 0 and cache.match(a) == []


def test_a_page_whose_bytes_changed_is_dropped_with_every_page_after_it_in_the_hit():
    alloc, data, cache = cache_with(8)
    a = keys("a", 5)
    pages = put(cache, data, a)
    corrupt, hits, misses = (metric(f"pdserve_prefill_prefix_{k}_pages_total") for k in ("corrupt", "hit", "miss"))
    other = cache.acquire(a[:4])  # another prompt reads pages 0..3 now
    data.crc[pages[2]] ^= 0x10  # a bit flips in place afterwards
    hit = cache.acquire(a)
    assert hit == pages[:2]
    assert metric("pdserve_prefill_prefix_corrupt_pages_total") - corrupt == 1
    assert metric("pdserve_prefill_prefix_hit_pages_total") - hits == 4 + 2
    assert metric("pdserve_prefill_prefix_miss_pages_total") - misses == 0 + 3
    # no later prompt finds it; the pages after it stay cached (each has its own checksum) but unreachable
    # until page 2 is computed again
    assert cache.match(a) == pages[:2] and cache.num_cached == 4
    free = alloc.num_free
    cache.release(hit)
    assert alloc.num_free == free  # the changed page is still pinned by the other prompt
    cache.release(other)
    assert alloc.num_free == free + 1 and pages[2] in alloc._free  # freed at its last unpin, not before
    again = cache.allocate(1)
    data.crc[again[0]] = 4242
    cache.insert([a[2]], again, data(again))  # recomputed: the whole chain is found again
    assert cache.match(a) == pages[:2] + again + pages[3:]


def test_a_changed_idle_page_is_freed_at_once():
    alloc, data, cache = cache_with(4)
    a = keys("a", 2)
    pages = put(cache, data, a)
    data.crc[pages[0]] += 1
    assert cache.acquire(a) == [] and cache.num_cached == 1 and alloc.num_free == 3


def test_a_chain_cached_already_frees_the_duplicate_and_the_first_copy_stays():
    alloc, data, cache = cache_with(6)
    a = keys("a", 2)
    first = put(cache, data, a)
    dup = cache.allocate(2)
    assert cache.insert(a, dup, [1, 2]) == 0
    assert alloc.num_free == 4 and cache.match(a) == first and cache.num_cached == 2


def test_the_page_limit_evicts_unpinned_pages_or_frees_the_new_ones():
    alloc, data, cache = cache_with(10, max_pages=3)
    a, b = keys("a", 3), keys("b", 2)
    pa = put(cache, data, a)
    held = cache.acquire(a[:1])
    pb = cache.allocate(2)
    data.crc.update(zip(pb, [7, 8]))
    assert cache.insert(b, pb, [7, 8]) == 2  # a's two unpinned pages made room, its pinned head stayed
    assert cache.num_cached == 3 and cache.match(a) == pa[:1] and cache.match(b) == pb
    pinned_b = cache.acquire(b)
    pc = cache.allocate(1)
    assert cache.insert(keys("c", 1), pc, [9]) == 0  # everything cached is pinned: the new page is freed
    assert cache.num_cached == 3 and alloc.num_free == 10 - 3
    cache.release(held)
    cache.release(pinned_b)
    with pytest.raises(ValueError, match="2 chain keys, 1 pages, 1 checksums"):
        cache.insert(keys("d", 2), [pc[0]], [1])


def test_off_caches_nothing_and_frees_what_it_is_given():
    alloc, data, cache = cache_with(4, max_pages=0)
    pages = cache.allocate(2)
    assert not cache.enabled and cache.insert(keys("a", 2), pages, [1, 2]) == 0
    assert alloc.num_free == 4 and cache.num_cached == 0 and cache.acquire(keys("a", 2)) == []
    assert metric("pdserve_prefill_prefix_cached_pages") == 0
