"""Prefill's queue over the prefix cache, with a fake forward pass: a prompt with a cached prefix starts after it
with only its own pages taken (and one more per cached page the destination lacks), cached pages nobody uses are
evicted before a prompt waits, and a hit whose copies could never fit the pool is cut to what fits."""
import asyncio
import time

from pdserve.engine.page_allocator import PageAllocator
from pdserve.engine.sampler import SamplingParams
from pdserve.prefill.batcher import Batcher
from pdserve.prefill.prefix_cache import PrefixCache
from pdserve.prefill.worker import Forward, Prompt

PS = 4


def keys(n: int) -> list[bytes]:
    return [f"k{i:02d}".encode().ljust(16, b".") for i in range(n)]


class Passes:
    def __init__(self):
        self.passes = []

    def __call__(self, chunks):
        self.passes.append([(p.token_ids[0], s, n) for p, s, n in chunks])
        return [Forward(len(p.token_ids), None, []) if s + n == len(p.token_ids) else None for p, s, n in chunks]


def setup(num_pages: int, cached: int):
    """A queue whose cache holds the first `cached` pages of chain keys() (page checksums all 0)."""
    alloc = PageAllocator(num_pages)
    cache = PrefixCache(alloc, lambda pages: [0] * len(pages))
    pages = cache.allocate(cached)
    cache.insert(keys(cached), pages, [0] * cached)
    fwd = Passes()
    return alloc, cache, fwd, Batcher(fwd, alloc, PS, max_batch_tokens=64, cache=cache), pages


async def run(b: Batcher, name: int, n: int, cached_pages: int = 0, deadline_s: float = 5.0, chains=None) -> Prompt:
    p = Prompt([name] + [0] * (n - 1), SamplingParams(), chains=keys(n // PS) if chains is None else chains,
               cached_pages=cached_pages)
    await b.result(b.submit(p, time.monotonic() + deadline_s))
    return p


def test_a_cached_prefix_is_skipped_and_only_the_prompts_own_pages_are_taken():
    async def main():
        alloc, cache, fwd, b, cached = setup(16, 3)
        p = await run(b, 1, 18, cached_pages=3)  # 5 pages, 3 cached here and at the destination
        assert fwd.passes == [[(1, 12, 6)]]
        assert p.hit == 3 and p.pages[:3] == cached and len(p.pages) == 5 and p.copies == []
        assert alloc.num_free == 16 - 3 - 2 and cache.num_idle == 0  # the hit is pinned until the caller is done
        q = await run(b, 2, 18, cached_pages=1)  # the destination lacks cached pages 1 and 2: two copies
        assert fwd.passes[-1] == [(2, 12, 6)] and len(q.copies) == 2 and not set(q.copies) & set(q.pages)
        assert alloc.num_free == 16 - 3 - 2 - 4
        cache.release(p.pages[:3])
        cache.release(q.pages[:3])
        assert cache.num_idle == 3

    asyncio.run(main())


def test_unused_cached_pages_are_evicted_before_a_prompt_waits():
    async def main():
        alloc, cache, fwd, b, cached = setup(6, 5)  # 1 page free, 5 cached that no prompt uses
        other = [k.replace(b"k", b"z") for k in keys(5)]  # another prompt's chain: no hit
        p = await run(b, 1, 20, chains=other)
        assert fwd.passes == [[(1, 0, 20)]] and p.hit == 0
        assert cache.match(keys(5)) == cached[:1]  # 4 evicted, the chain's tail first: its head is still found
        assert alloc.num_free == 0

    asyncio.run(main())


def test_a_hit_whose_copies_cannot_fit_the_pool_is_cut_to_what_fits():
    async def main():
        alloc, cache, fwd, b, cached = setup(4, 3)
        # 16 tokens: 4 pages of its own, 3 reusable pages cached here, none at the destination: with 3 copies it
        # would need 7 pages of a pool of 4, and wait until its deadline
        p = await run(b, 1, 16, cached_pages=0, deadline_s=2.0)
        assert fwd.passes == [[(1, 0, 16)]] and p.hit == 0 and cache.num_cached == 0  # the 3 were evicted
        alloc.deallocate(p.own_pages)
        cached = cache.allocate(3)
        cache.insert(keys(3), cached, [0] * 3)
        q = await run(b, 2, 16, cached_pages=2, deadline_s=2.0)  # 2 at the destination: a hit of 2 fits
        assert fwd.passes[-1] == [(2, 8, 8)] and q.hit == 2 and q.copies == []

    asyncio.run(main())
