"""Cached (shared, read-only) pages in the lease table, rule by rule: Publish, Grants that share a prefix, LRU
eviction of unread pages only, the end of one reader's share, Unpublish, restarts and fences; and the same over
gRPC with the metrics (the Hypothesis state machine is in test_lease_machine.py)."""
import asyncio

import grpc

from pdserve.broker import pages
from pdserve.broker.lease_table import LeaseTable, PageState
from pdserve.common import prefix
from pdserve.common.proto import broker_pb2 as pb, common_pb2

from .test_lease_table import FakeClock, refused
from .test_servicer import REGION, refused as grpc_refused, serving

A, B, C, D = (bytes([i]) * 16 for i in b"abcd")
K = [bytes([0xC0 + i]) * 16 for i in range(6)]  # chain keys of pages 0, 1, 2, ...
T, U = b"t" * 8, b"u" * 8  # two scope tags
EPOCH, LOCK_DELAY = 7, 2.0


def make(num_pages: int = 8) -> tuple[LeaseTable, FakeClock]:
    clock = FakeClock()
    table = LeaseTable(lock_delay_s=LOCK_DELAY, default_writer_ttl_s=10.0, clock=clock, epoch=EPOCH,
                       reader_ttl_s=float("inf"))
    table.register_pool("p", num_pages)
    return table, clock


def written(table: LeaseTable, owner: bytes, num_pages: int, success: bool = True) -> list[tuple[int, int]]:
    """A grant whose pages a prefill wrote (success) or failed to write."""
    leases = table.grant("p", owner, num_pages, EPOCH)
    table.begin_write("p", owner, EPOCH, leases, "w", 1.0)
    table.end_write("p", owner, EPOCH, leases, "w", success)
    return leases


def cached(table: LeaseTable, owner: bytes, num_pages: int, num_published: int, tag: bytes = T,
           first_chain: int = 0) -> list[tuple[int, int]]:
    leases = written(table, owner, num_pages)
    chains = K[first_chain:first_chain + num_published]
    assert table.publish("p", owner, EPOCH, leases[:num_published], chains,
                         [100 + i for i in range(num_published)], tag) == [True] * num_published
    return leases


def state(table: LeaseTable, *keys: str) -> tuple:
    s = table.pool_state("p")
    return tuple(s[k] for k in keys)


def test_a_grant_shares_the_longest_cached_run_under_its_scope_tag_at_the_cached_generation():
    table, _ = make(num_pages=10)
    a = cached(table, A, 4, 3)  # pages 0-2 cached at generation 1, page 3 stays A's own
    assert state(table, "num_cached", "num_shared_reads", "num_leased", "num_free") == (3, 3, 1, 6)
    leases, num_shared, checksums = table.grant_with_prefix("p", B, 4, EPOCH, K[:3], T)
    assert (num_shared, checksums) == (3, [100, 101, 102])
    assert leases[:3] == a[:3] and leases[3] == (4, 2)  # shared first, then one fresh page at a new generation
    assert table.leases_of("p", B) == leases
    assert table.page_info("p", 0).readers == {A, B} and table.page_info("p", 0).state is PageState.CACHED
    assert state(table, "num_cached", "num_shared_reads", "num_leased", "num_free") == (3, 6, 2, 5)
    assert table.take_prefix_counts() == {"published": 3, "hits": 3}
    # the run stops at the first chain not cached, and leaves the last page to be written
    assert table.grant_with_prefix("p", C, 4, EPOCH, [K[0], K[5], K[2]], T)[1:] == (1, [100])
    assert table.grant_with_prefix("p", D, 2, EPOCH, K[:3], T)[1:] == (1, [100])


def test_a_chain_cached_under_another_scope_tag_is_never_shared_and_is_counted():
    table, _ = make()
    cached(table, A, 2, 1, tag=T)                  # K0 under T
    cached(table, B, 2, 1, tag=U, first_chain=1)   # K1 under U
    table.take_prefix_counts()
    leases, num_shared, checksums = table.grant_with_prefix("p", C, 3, EPOCH, K[:2], T)
    assert (num_shared, checksums) == (1, [100]) and leases[0] == (0, 1)  # stops at K1: U is not C's scope
    leases, num_shared, _ = table.grant_with_prefix("p", D, 2, EPOCH, K[:1], U)
    assert num_shared == 0 and leases[0][0] not in (0, 2)
    assert table.take_prefix_counts() == {"hits": 1, "cross_scope": 2}
    assert table.page_info("p", 0).readers == {A, C} and table.page_info("p", 2).readers == {B}


def test_a_shared_page_is_never_written_or_validated_by_anyone():
    table, _ = make()
    a = cached(table, A, 3, 2)
    b, _, _ = table.grant_with_prefix("p", B, 3, EPOCH, K[:2], T)
    for owner, lease in ((A, a[0]), (B, b[0]), (B, b[1])):
        err = refused("FAILED_PRECONDITION", "LEASE_NOT_CURRENT", table.begin_write, "p", owner, EPOCH, [lease],
                      "w2", 1.0)
        assert "is CACHED at generation 1" in err.message
        refused("FAILED_PRECONDITION", "LEASE_NOT_CURRENT", table.validate, "p", owner, EPOCH, [lease])
    # B's own page is written as ever; a write that also names a shared page is refused whole
    refused("FAILED_PRECONDITION", "LEASE_NOT_CURRENT", table.begin_write, "p", B, EPOCH, b, "w2", 1.0)
    assert table.page_info("p", b[2][0]).active_writer is None
    table.begin_write("p", B, EPOCH, b[2:], "w2", 1.0)
    assert table.end_write("p", B, EPOCH, b[:2], "w2", True) == 0  # an ack naming shared pages changes nothing
    assert table.page_info("p", 0).active_writer is None and table.pool_state("p")["num_writing"] == 1


def test_publish_takes_only_the_owners_written_sealed_pages_of_new_chains():
    table, clock = make(num_pages=12)
    a = written(table, A, 3)
    unwritten = table.grant("p", B, 2, EPOCH)
    failed = written(table, C, 2, success=False)
    writing = table.grant("p", D, 1, EPOCH)
    table.begin_write("p", D, EPOCH, writing, "w2", 1.0)
    publish = table.publish
    assert publish("p", B, EPOCH, unwritten[:1], K[:1], [1], T) == [False]      # granted, never written
    assert publish("p", C, EPOCH, failed[:1], K[:1], [1], T) == [False]         # its write failed
    assert publish("p", D, EPOCH, writing, K[:1], [1], T) == [False]            # still being written
    assert publish("p", B, EPOCH, a[:1], K[:1], [1], T) == [False]              # another owner's page
    assert publish("p", A, EPOCH, [(a[0][0], 9)], K[:1], [1], T) == [False]     # not its generation
    assert publish("p", A, EPOCH, [(99, 1)], K[:1], [1], T) == [False]          # no such page
    assert publish("p", A, EPOCH, a, [K[0], K[0], K[1]], [1, 2, 3], T) == [True, False, True]  # K0 once
    assert publish("p", A, EPOCH, a[:1], K[2:3], [1], T) == [False]             # cached already
    # the failed write's hold ends (lock_delay after its ack): its pages are still never cached
    clock.now += LOCK_DELAY + 0.1
    table.sweep()
    assert table.page_info("p", failed[0][0]).active_writer is None
    assert publish("p", C, EPOCH, failed, K[3:5], [1, 2], T) == [False, False]
    # decode's Validate stands for a check of the bytes, as a successful write does
    table.validate("p", B, EPOCH, unwritten)
    assert publish("p", B, EPOCH, unwritten, K[3:5], [1, 2], T) == [True, True]
    assert table.take_prefix_counts() == {"published": 4}
    assert state(table, "num_cached", "num_shared_reads") == (4, 4)


def test_publish_and_grant_refuse_malformed_arguments_with_their_sizes():
    table, _ = make()
    a = written(table, A, 2)
    err = refused("INVALID_ARGUMENT", "BAD_PUBLISH", table.publish, "p", A, EPOCH, a, K[:1], [1, 2], T)
    assert "2 leases, 1 chains and 2 checksums" in err.message
    err = refused("INVALID_ARGUMENT", "BAD_CHAIN", table.publish, "p", A, EPOCH, a, [K[0], b"x" * 15], [1, 2], T)
    assert "chains[1] is 15 bytes, not 16" in err.message
    err = refused("INVALID_ARGUMENT", "BAD_SCOPE_TAG", table.publish, "p", A, EPOCH, a, K[:2], [1, 2], b"t" * 7)
    assert "7 bytes, not 8" in err.message
    refused("INVALID_ARGUMENT", "BAD_SCOPE_TAG", table.publish, "p", A, EPOCH, [], [], [], b"")
    err = refused("INVALID_ARGUMENT", "BAD_CHECKSUM", table.publish, "p", A, EPOCH, a, K[:2], [1, 2**32], T)
    assert str(2**32) in err.message
    refused("FAILED_PRECONDITION", "EPOCH_MISMATCH", table.publish, "p", A, EPOCH + 1, a, K[:2], [1, 2], T)
    err = refused("INVALID_ARGUMENT", "BAD_CHAIN", table.grant_with_prefix, "p", B, 3, EPOCH, [K[0], b"k"], T)
    assert "prefix_chains[1] is 1 bytes" in err.message
    refused("INVALID_ARGUMENT", "BAD_SCOPE_TAG", table.grant_with_prefix, "p", B, 3, EPOCH, K[:1], b"")
    assert state(table, "num_cached", "num_leased") == (0, 2) and table.leases_of("p", B) == []


def test_one_readers_release_leaves_the_page_cached_for_the_others():
    table, _ = make()
    cached(table, A, 3, 2)
    table.grant_with_prefix("p", B, 3, EPOCH, K[:2], T)
    assert table.release("p", A, EPOCH) == (1, 0)  # A's own page freed; its shares end, the pages stay
    assert table.page_info("p", 0).readers == {B} and table.num_unread_cached("p") == 0
    assert state(table, "num_cached", "num_shared_reads", "num_leased") == (2, 2, 1)
    assert table.release("p", B, EPOCH) == (1, 0)
    assert table.num_unread_cached("p") == 2
    assert state(table, "num_cached", "num_shared_reads", "num_leased", "num_free", "num_evictable") == (2, 0, 0, 6, 2)
    # still found: a later grant of the same prefix reads them again
    assert table.grant_with_prefix("p", C, 3, EPOCH, K[:2], T)[1] == 2 and table.num_unread_cached("p") == 0


def test_a_short_grant_evicts_unread_pages_least_recently_read_first_and_never_a_read_one():
    table, _ = make(num_pages=8)
    cached(table, A, 3, 2)                   # K0, K1 on pages 0, 1
    cached(table, B, 3, 2, first_chain=2)    # K2, K3 on pages 3, 4
    table.release("p", B, EPOCH)             # 3, 4 unread first
    table.release("p", A, EPOCH)             # then 0, 1
    table.grant_with_prefix("p", C, 2, EPOCH, K[:1], T)  # page 0 read again: out of the LRU
    assert state(table, "num_free") == (3,) and table.num_unread_cached("p") == 3
    table.take_prefix_counts()
    assert [p for p, _ in table.grant("p", D, 5, EPOCH)] == [3, 4, 5, 6, 7]  # 3 free, then the two oldest unread
    assert table.take_prefix_counts() == {"evicted_lru": 2}
    assert [table.page_info("p", p).state for p in (0, 1)] == [PageState.CACHED, PageState.CACHED]
    info = table.page_info("p", 3)
    assert (info.state, info.owner, info.chain) == (PageState.LEASED, D, b"")  # K2 left the index with the page
    # what remains unread is page 1; page 0 is read by C: a grant it cannot satisfy evicts nothing
    err = refused("RESOURCE_EXHAUSTED", "POOL_EXHAUSTED", table.grant, "p", B, 3, EPOCH)
    assert "has 0 free pages of 8; 3 requested (0 of them cached), and 1 unread cached pages to evict" in err.message
    assert table.page_info("p", 1).state is PageState.CACHED and table.num_unread_cached("p") == 1
    assert table.grant("p", B, 1, EPOCH) == [(1, 5)] and table.page_info("p", 0).readers == {C}


def test_a_grant_never_evicts_the_pages_it_shares():
    table, _ = make(num_pages=4)
    cached(table, A, 4, 3)  # pages 0-2 cached, page 3 A's own
    table.release("p", A, EPOCH)  # one free page, three unread
    leases, num_shared, _ = table.grant_with_prefix("p", B, 4, EPOCH, K[:2], T)
    assert num_shared == 2 and [p for p, _ in leases] == [0, 1, 2, 3]  # page 2 evicted for the second fresh page
    assert [table.page_info("p", p).state for p in range(4)] == [PageState.CACHED] * 2 + [PageState.LEASED] * 2
    assert table.page_info("p", 2).chain == b""
    # K2 left the index with its page, and the pages B reads are not evictable
    err = refused("RESOURCE_EXHAUSTED", "POOL_EXHAUSTED", table.grant_with_prefix, "p", C, 2, EPOCH, K[2:3], T)
    assert "0 unread cached pages to evict" in err.message


def test_extend_evicts_unread_cached_pages_too():
    table, _ = make(num_pages=4)
    cached(table, A, 2, 1)
    table.release("p", A, EPOCH)
    table.grant("p", B, 2, EPOCH)
    [grown] = table.extend("p", EPOCH, [(B, 2)])
    assert [p for p, _ in grown] == [0, 3] and state(table, "num_cached") == (0,)
    [short] = table.extend("p", EPOCH, [(B, 1)])
    assert short.reason == "POOL_EXHAUSTED" and "0 unread cached pages to evict" in short.message


def test_revoking_one_reader_ends_only_its_share_and_quarantines_only_its_own_pages():
    table, _ = make()
    a = cached(table, A, 3, 2)
    b, _, _ = table.grant_with_prefix("p", B, 3, EPOCH, K[:2], T)
    assert table.revoke("p", B, "TEST") == (0, 1)  # B's own page is held until its decode acknowledges
    assert table.page_info("p", b[2][0]).state is PageState.QUARANTINED
    for page, _ in a[:2]:
        info = table.page_info("p", page)
        assert (info.state, info.readers, info.active_writer) == (PageState.CACHED, {A}, None)
    assert table.grant_with_prefix("p", C, 3, EPOCH, K[:2], T)[1] == 2  # still shared with the next request


def test_a_revoked_last_reader_pins_its_pages_until_acknowledged_plus_lock_delay():
    """Its step may still read the page: evicted and granted again, the page could carry another request's KV
    into that step's output, so it stays cached (and shared) until the revocation's hold ends."""
    table, clock = make(num_pages=4)
    cached(table, A, 2, 1)
    table.grant_with_prefix("p", B, 2, EPOCH, K[:1], T)
    table.release("p", A, EPOCH)
    table.revoke("p", B, "TEST")
    assert table.num_unread_cached("p") == 0 and table.page_info("p", 0).pins == {f"revoked/p/{B.hex()}"}
    refused("RESOURCE_EXHAUSTED", "POOL_EXHAUSTED", table.grant, "p", C, 3, EPOCH)
    clock.now += 100.0
    table.sweep()
    assert table.num_unread_cached("p") == 0  # no acknowledgement yet: held however long
    table.reader_keep_alive("p", [], table.last_seq("p"))
    clock.now += LOCK_DELAY - 0.1
    table.sweep()
    assert table.num_unread_cached("p") == 0
    clock.now += 0.2
    table.sweep()
    assert table.num_unread_cached("p") == 1 and table.page_info("p", 0).pins == frozenset()
    assert [p for p, _ in table.grant("p", C, 4, EPOCH)] == [0, 1, 2, 3]


def test_unpublished_pages_leave_the_index_at_once_and_free_through_quarantine_once_unread():
    table, clock = make()
    a = cached(table, A, 3, 2)
    b, _, _ = table.grant_with_prefix("p", B, 3, EPOCH, K[:2], T)
    table.take_prefix_counts()
    assert table.unpublish("p", C, EPOCH, a[:1], "CHECKSUM") == 0        # not a reader
    assert table.unpublish("p", B, EPOCH, [(0, 9)], "CHECKSUM") == 0     # not its generation
    assert table.unpublish("p", B, EPOCH + 1, b[:1], "CHECKSUM") == 0    # a stale epoch: a no-op
    assert table.unpublish("p", B, EPOCH, [b[0], (99, 1)], "CHECKSUM") == 1
    assert table.unpublish("p", A, EPOCH, a[:1], "TAG_CHAIN") == 0       # out of the index already
    assert table.take_prefix_counts() == {"evicted_corrupt": 1}
    assert table.grant_with_prefix("p", C, 3, EPOCH, K[:2], T)[1] == 0   # no later grant finds it
    assert table.page_info("p", 0).state is PageState.CACHED              # its readers still hold it
    table.release("p", A, EPOCH)
    table.release("p", B, EPOCH)
    info = table.page_info("p", 0)
    assert (info.state, info.active_writer) == (PageState.QUARANTINED, ("unpublished/p", 1))
    assert table.page_info("p", 1).state is PageState.CACHED and table.num_unread_cached("p") == 1
    assert state(table, "num_cached", "num_quarantined") == (1, 1)
    clock.now += LOCK_DELAY - 0.1
    assert table.sweep() == 0
    clock.now += 0.2
    assert table.sweep() == 1 and table.page_info("p", 0).state is PageState.FREE


def test_a_new_epoch_knows_no_cached_page_and_quarantines_what_decode_held():
    table, _ = make()
    cached(table, A, 3, 2)
    restarted = LeaseTable(lock_delay_s=LOCK_DELAY, clock=table._clock, epoch=EPOCH + 1, reader_ttl_s=float("inf"))
    restarted.register_pool("p", 8, quarantined=[0, 1, 2])  # decode held them, cached or not
    assert [restarted.page_info("p", p).state for p in range(3)] == [PageState.QUARANTINED] * 3
    leases, num_shared, _ = restarted.grant_with_prefix("p", B, 3, EPOCH + 1, K[:2], T)
    assert num_shared == 0 and [p for p, _ in leases] == [3, 4, 5]
    assert (restarted.pool_state("p")["num_cached"], restarted.take_prefix_counts()) == (0, {})


def test_a_fenced_pool_shares_nothing_and_is_forgotten_with_cached_pages_in_it():
    clock = FakeClock()
    table = LeaseTable(lock_delay_s=LOCK_DELAY, clock=clock, epoch=EPOCH, reader_ttl_s=5.0)
    table.register_pool("p", 4)
    cached(table, A, 2, 1)
    clock.now += 5.0
    refused("UNAVAILABLE", "POOL_FENCED", table.grant_with_prefix, "p", B, 2, EPOCH, K[:1], T)
    refused("UNAVAILABLE", "POOL_FENCED", table.publish, "p", A, EPOCH, [(1, 1)], K[1:2], [1], T)
    table.sweep()  # the reader expired: A is revoked, its share ends (pinned until the fence's lock_delay)
    assert state(table, "num_shared_reads", "num_cached") == (0, 1)
    clock.now += LOCK_DELAY
    table.sweep()
    assert table.forget_pools() == ["p"]


def test_the_sizes_are_the_chain_keys_and_scope_tags_decode_makes():
    scope = prefix.scope_key("tenant-a", "")
    key = prefix.page_chains(prefix.chain_seed(scope, b"ckpt", 4, "float32"), list(range(8)), 4)[0]
    assert (len(key), len(prefix.scope_tag(scope))) == (pages.CHAIN_NBYTES, pages.SCOPE_TAG_NBYTES)


# --- over gRPC --------------------------------------------------------------------------------------------------

POOL = "decode/d0/x"


def lease_msgs(leases):
    return [common_pb2.PageLease(page=p, generation=g) for p, g in leases]


def test_grant_publish_unpublish_and_pool_state_over_grpc_with_their_metrics():
    async def main():
        clock = FakeClock()
        table = LeaseTable(lock_delay_s=LOCK_DELAY, clock=clock)  # the clock stands still: never fenced
        async with serving(table) as (_, stub, registry):
            def sample(name, **labels):
                return registry.get_sample_value(name, labels)
            assert [sample("pdserve_prefix_cache_hits_total", service="broker"),
                    sample("pdserve_prefix_cache_cross_scope_total", service="broker"),
                    sample("pdserve_prefix_cache_evictions_total", reason="lru"),
                    sample("pdserve_prefix_cache_evictions_total", reason="corrupt"),
                    sample("pdserve_prefix_cache_published_total")] == [0, 0, 0, 0, 0]
            epoch = (await stub.RegisterPool(pb.RegisterPoolRequest(pool_id=POOL, num_pages=6, region=REGION))).epoch
            a = await stub.Grant(pb.GrantRequest(pool_id=POOL, owner=A, num_pages=2, epoch=epoch))
            leases = [(m.page, m.generation) for m in a.leases]
            table.begin_write(POOL, A, epoch, leases, "w", 1.0)
            table.end_write(POOL, A, epoch, leases, "w", True)
            pub = await stub.Publish(pb.PublishRequest(pool_id=POOL, owner=A, epoch=epoch, leases=a.leases,
                                                       chains=K[:2], checksums=[11, 12], scope_tag=T))
            assert list(pub.published) == [True, True]
            b = await stub.Grant(pb.GrantRequest(pool_id=POOL, owner=B, num_pages=2, epoch=epoch,
                                                 prefix_chains=K[:2], scope_tag=T))
            assert (b.num_shared, list(b.shared_checksums), b.leases[0]) == (1, [11], a.leases[0])
            c = await stub.Grant(pb.GrantRequest(pool_id=POOL, owner=C, num_pages=2, epoch=epoch,
                                                 prefix_chains=K[:1], scope_tag=U))
            assert c.num_shared == 0
            s = await stub.GetPoolState(pb.GetPoolStateRequest(pool_id=POOL))
            assert (s.num_cached, s.num_shared_reads, s.num_leased, s.num_free) == (2, 3, 3, 1)
            assert sample("pdserve_kv_pages", pool=POOL, state="cached") == 2
            assert sample("pdserve_prefix_cache_shared_reads", pool=POOL) == 3
            un = await stub.Unpublish(pb.UnpublishRequest(pool_id=POOL, owner=B, epoch=epoch, leases=b.leases[:1],
                                                          reason="CHECKSUM"))
            assert un.num_unpublished == 1
            await stub.Release(pb.ReleaseRequest(pool_id=POOL, owner=A, epoch=epoch))
            assert [sample("pdserve_prefix_cache_pages", pool=POOL, state=st) for st in ("read", "unread")] == [1, 1]
            # a grant short of free pages evicts the unread one
            await stub.Release(pb.ReleaseRequest(pool_id=POOL, owner=C, epoch=epoch))
            d = await stub.Grant(pb.GrantRequest(pool_id=POOL, owner=D, num_pages=4, epoch=epoch))
            assert [m.page for m in d.leases] == [1, 3, 4, 5]
            assert [sample("pdserve_prefix_cache_hits_total", service="broker"),
                    sample("pdserve_prefix_cache_cross_scope_total", service="broker"),
                    sample("pdserve_prefix_cache_evictions_total", reason="lru"),
                    sample("pdserve_prefix_cache_evictions_total", reason="corrupt"),
                    sample("pdserve_prefix_cache_published_total")] == [1, 1, 1, 1, 2]
            err = await grpc_refused(stub.Publish(pb.PublishRequest(
                pool_id=POOL, owner=D, epoch=epoch, leases=d.leases[:1], chains=[b"k"], checksums=[1], scope_tag=T)),
                grpc.StatusCode.INVALID_ARGUMENT, "BAD_CHAIN")
            assert "chains[0] is 1 bytes" in err.message
    asyncio.run(main())


def test_a_stopping_broker_refuses_publish_but_takes_unpublish_and_counts_a_refused_grants_cross_scope_match():
    async def main():
        table = LeaseTable(lock_delay_s=LOCK_DELAY, clock=FakeClock())
        async with serving(table) as (servicer, stub, registry):
            epoch = (await stub.RegisterPool(pb.RegisterPoolRequest(pool_id=POOL, num_pages=2, region=REGION))).epoch
            leases = table.grant(POOL, A, 2, epoch)
            table.begin_write(POOL, A, epoch, leases, "w", 1.0)
            table.end_write(POOL, A, epoch, leases, "w", True)
            table.publish(POOL, A, epoch, leases[:1], K[:1], [5], T)
            # under another scope tag, and short of pages: refused, the match is counted all the same
            await grpc_refused(stub.Grant(pb.GrantRequest(pool_id=POOL, owner=B, num_pages=2, epoch=epoch,
                                                          prefix_chains=K[:1], scope_tag=U)),
                               grpc.StatusCode.RESOURCE_EXHAUSTED, "POOL_EXHAUSTED")
            assert registry.get_sample_value("pdserve_prefix_cache_cross_scope_total", {"service": "broker"}) == 1
            servicer.stop_accepting()
            await grpc_refused(stub.Publish(pb.PublishRequest(pool_id=POOL, owner=A, epoch=epoch, leases=lease_msgs(
                leases[1:]), chains=K[1:2], checksums=[6], scope_tag=T)), grpc.StatusCode.UNAVAILABLE, "BROKER_STOPPING")
            un = await stub.Unpublish(pb.UnpublishRequest(pool_id=POOL, owner=A, epoch=epoch,
                                                          leases=lease_msgs(leases[:1]), reason="CHECKSUM"))
            assert un.num_unpublished == 1 and table.pool_state(POOL)["num_cached"] == 1
    asyncio.run(main())
