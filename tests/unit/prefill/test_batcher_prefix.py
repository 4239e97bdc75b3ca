"""Prefill's queue over the prefix cache, with a fake forward pass: a prompt with a cached prefix starts after it
with only its own pages taken (and one more per cached page the destination lacks), cached pages nobody uses are
evicted before a prompt waits, a hit whose copies could never fit the pool is cut to what fits, and a prompt whose
prefix another prompt is computing waits for those pages rather than computing them again."""
import asyncio
import time

from pdserve.common.metrics import PREFIX_WAITS
from pdserve.engine.sampler import SamplingParams
from pdserve.prefill.batcher import Batcher
from pdserve.prefill.local_pages import LocalPages
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
    local = LocalPages(num_pages, lambda pages: [0] * len(pages))
    alloc, cache = local.alloc, local.cache
    pages = cache.allocate(cached) if cached else []
    cache.insert(keys(cached), pages, [0] * cached)
    fwd = Passes()
    return alloc, cache, fwd, Batcher(fwd, local, PS, max_batch_tokens=64), pages


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
        b.computed(p)  # its write ended (and page 3 was not cached): a prompt needing page 3 computes it
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
        b.local.finish(p.reservation)  # its write failed: nothing of it is cached
        cached = cache.allocate(3)
        cache.insert(keys(3), cached, [0] * 3)
        q = await run(b, 2, 16, cached_pages=2, deadline_s=2.0)  # 2 at the destination: a hit of 2 fits
        assert fwd.passes[-1] == [(2, 8, 8)] and q.hit == 2 and q.copies == []

    asyncio.run(main())


def test_prompts_over_one_new_prefix_compute_it_once():
    """Three prompts over the same 4 uncached pages arrive together, and one over another chain behind them: the
    first computes the prefix, the other two wait for its pages (the unrelated one passes them meanwhile), then
    compute only their own last page from the cache."""
    async def main():
        alloc, cache, fwd, b, _ = setup(32, 0)
        shared = keys(4)
        prompts = [Prompt([i] + [0] * 17, SamplingParams(), chains=shared) for i in (1, 2, 3)]
        other = Prompt([4] + [0] * 7, SamplingParams(), chains=[b"z" * 16, b"y" * 16])
        items = [b.submit(p, time.monotonic() + 5) for p in (*prompts, other)]
        first = await b.result(items[0])
        assert first is not None and fwd.passes[0] == [(1, 0, 18), (4, 0, 8)]
        await asyncio.sleep(0.05)
        assert not items[1].started and not items[2].started  # waiting: nothing computed twice meanwhile
        # what the servicer does once the first prompt's write succeeded: its full pages enter the cache
        p0 = prompts[0]
        b.local.finish(p0.reservation, {})
        b.computed(p0)
        await asyncio.gather(b.result(items[1]), b.result(items[2]))
        assert fwd.passes[1:] == [[(2, 16, 2), (3, 16, 2)]]
        assert prompts[1].hit == prompts[2].hit == 4 and prompts[1].pages[:4] == p0.pages[:4]
        assert PREFIX_WAITS._value.get() - waits_before == 2

    waits_before = PREFIX_WAITS._value.get()
    asyncio.run(main())


def test_a_prompt_waiting_for_a_prefix_computes_it_when_the_write_fails():
    """The first prompt's write fails: none of its pages are cached, and the waiting prompt computes them."""
    async def main():
        alloc, cache, fwd, b, _ = setup(32, 0)
        prompts = [Prompt([i] + [0] * 17, SamplingParams(), chains=keys(4)) for i in (1, 2)]
        items = [b.submit(p, time.monotonic() + 5) for p in prompts]
        await b.result(items[0])
        await asyncio.sleep(0.05)
        assert not items[1].started
        b.computed(prompts[0])  # freed, not cached
        await b.result(items[1])
        assert fwd.passes[1:] == [[(2, 0, 18)]] and prompts[1].hit == 0

    asyncio.run(main())
