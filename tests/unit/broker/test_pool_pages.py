"""A pool's page table on its own: each transition keeps the sets in step with the pages (free, quarantined,
writing), and refuses, with nothing changed, a page whose state does not allow it (PageStateError: a broker bug,
so the call fails closed instead of handing out a page someone else may hold)."""
import dataclasses
import heapq

import pytest

from pdserve.broker.pages import PageState, PageStateError, PoolPages

A, B = b"a" * 16, b"b" * 16
CHAIN, TAG = b"c" * 16, b"t" * 8


def snapshot(pool: PoolPages):
    return ([dataclasses.astuple(page) for page in pool.pages], sorted(pool.free), set(pool.quarantined),
            set(pool.writing), {o: list(p) for o, p in pool.owners.items()}, dict(pool.cache.index),
            list(pool.cache.lru))


def assert_in_step(pool: PoolPages) -> None:
    pages = list(enumerate(pool.pages))
    assert sorted(pool.free) == [i for i, p in pages if p.state is PageState.FREE]
    assert pool.quarantined == {i for i, p in pages if p.state is PageState.QUARANTINED}
    assert pool.writing == {i for i, p in pages if p.active_writer is not None}
    assert all(p.active_writer[1] == p.generation for _, p in pages if p.active_writer is not None)


def refused(pool: PoolPages, fn, *args) -> None:
    before = snapshot(pool)
    with pytest.raises(PageStateError):
        fn(*args)
    assert snapshot(pool) == before


def leased(num_pages: int = 4, num: int = 2) -> tuple[PoolPages, list[int], int]:
    pool = PoolPages("p", num_pages)
    generation = pool.new_generation()
    pool.open_owner(A, 0.0)
    return pool, pool.lease(A, num, generation), generation


def test_lease_takes_the_lowest_free_pages_and_refuses_a_page_that_is_not_free():
    pool, taken, generation = leased()
    assert taken == [0, 1] and pool.owners[A] == [0, 1]
    assert [(p.state, p.owner, p.generation) for p in pool.pages[:2]] == [(PageState.LEASED, A, generation)] * 2
    assert_in_step(pool)
    heapq.heappush(pool.free, 0)  # a leased page back on the free heap: the bug a check must catch
    refused(pool, pool.lease, A, 1, generation)
    pool.free.remove(0)
    heapq.heapify(pool.free)
    refused(pool, pool.lease, A, 3, generation)  # more than are free
    refused(pool, pool.lease, B, 1, generation)  # B holds nothing here yet
    refused(pool, pool.open_owner, A, 1.0)  # A is open already


def test_a_write_is_begun_on_leased_pages_without_a_writer_only_and_ended_once():
    pool, taken, generation = leased()
    leases = [(page_id, generation) for page_id in taken]
    pool.begin_write(A, leases[:1], "w")
    assert pool.pages[0].active_writer == ("w", generation)
    assert [p.sealed_generation for p in pool.pages[:2]] == [generation] * 2  # the whole grant's generation
    assert_in_step(pool)
    refused(pool, pool.begin_write, A, leases, "w2")  # page 0 has a writer
    refused(pool, pool.end_write, 1, True)  # page 1 has none
    refused(pool, pool.drain_write, 1, "failed/w")
    assert pool.end_write(0, True) is False  # LEASED: not freed, but written
    assert pool.pages[0].written_generation == generation and pool.writing == set()
    refused(pool, pool.end_write, 0, True)
    assert_in_step(pool)


def test_a_lease_ends_free_or_in_quarantine_while_its_writer_may_land_and_only_for_its_owner():
    pool, taken, generation = leased()
    pool.begin_write(A, [(0, generation)], "w")
    refused(pool, pool.end_lease, 0, B)
    assert pool.end_owner(A) == taken
    assert pool.end_lease(0, A) is False and pool.end_lease(1, A) is True
    assert (pool.pages[0].state, pool.pages[1].state) == (PageState.QUARANTINED, PageState.FREE)
    assert_in_step(pool)
    refused(pool, pool.end_lease, 1, A)  # free already
    assert pool.end_write(0, False) is True  # the writer presumed dead: out of quarantine
    assert_in_step(pool)
    assert sorted(pool.free) == [0, 1, 2, 3]


def test_only_a_written_sealed_page_is_published_and_only_an_unread_one_evicted():
    pool, taken, generation = leased()
    assert pool.publish(0, A, generation, CHAIN, 7, TAG) is False  # never written
    before = snapshot(pool)
    assert pool.publish(0, B, generation, CHAIN, 7, TAG) is False and snapshot(pool) == before
    pool.seal_checked(0, generation)
    refused(pool, pool.seal_checked, 2, generation)  # not leased
    assert pool.publish(0, A, generation, CHAIN, 7, TAG) is True
    assert pool.publish(1, A, generation, CHAIN, 7, TAG) is False  # the chain is cached already
    page = pool.pages[0]
    assert (page.state, page.owner, page.readers, pool.cache.find(CHAIN)) == (PageState.CACHED, None, {A}, 0)
    refused(pool, pool.evict, 0)  # A still reads it
    refused(pool, pool.end_share, 0, B, None)  # B never did
    pool.end_share(0, A, None)
    assert pool.settle(0, "unpublished/p") is False and list(pool.cache.lru) == [0]
    pool.evict(0)
    assert pool.pages[0].state is PageState.FREE and pool.cache.find(CHAIN) is None
    assert_in_step(pool)
    refused(pool, pool.evict, 0)
    refused(pool, pool.settle, 0, "unpublished/p")
    refused(pool, pool.share, A, [0])  # a free page is never shared


def test_an_unpublished_page_goes_through_quarantine_once_unread_and_unpinned():
    pool, _, generation = leased()
    pool.seal_checked(0, generation)
    assert pool.publish(0, A, generation, CHAIN, 7, TAG)
    pool.open_owner(B, 1.0)
    pool.share(B, [0])
    assert pool.unpublish(0, A, generation + 1) is False  # not the generation A reads
    assert pool.unpublish(0, A, generation) is True and pool.unpublish(0, B, generation) is False  # once
    pool.end_share(0, A, "revoked/p/a")  # a revoked reader's step may still read it: pinned
    pool.end_share(0, B, None)
    assert pool.settle(0, "unpublished/p") is False
    assert pool.unpin(0, frozenset({"revoked/p/a"})) is False
    assert pool.unpin(0, frozenset()) is True
    assert pool.settle(0, "unpublished/p") is True
    assert (pool.pages[0].state, pool.pages[0].active_writer) == (PageState.QUARANTINED, ("unpublished/p", generation))
    assert_in_step(pool)


def test_hold_quarantines_free_pages_only():
    pool, _, _ = leased()
    refused(pool, pool.hold, [1, 2], "earlier-epoch/p")  # page 1 is leased
    pool.hold([2, 3], "earlier-epoch/p")
    assert sorted(pool.free) == [] and pool.quarantined == {2, 3}
    assert_in_step(pool)
