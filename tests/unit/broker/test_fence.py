"""The fence between broker incarnations: a pool whose decode stopped renewing it takes no Grant, BeginWrite
or writer renewal; once nothing of it is held it is forgotten (pages, log, metric series), and a late call
from its decode gets NOT_FOUND. Memory stays bounded however many decode incarnations come and go."""
import asyncio

import grpc
import pytest
from prometheus_client import CollectorRegistry

from pdserve.broker.lease_table import LeaseError, LeaseTable
from pdserve.broker.servicer import BrokerServicer
from pdserve.common.proto import broker_pb2 as pb

from .test_lease_table import FakeClock
from .test_servicer import REGION, refused, serving

A, B = b"a" * 16, b"b" * 16
LOCK_DELAY, READER_TTL, MAX_TTL = 2.0, 5.0, 8.0


def make() -> tuple[LeaseTable, FakeClock]:
    clock = FakeClock()
    table = LeaseTable(lock_delay_s=LOCK_DELAY, default_writer_ttl_s=4.0, clock=clock, epoch=7,
                       reader_ttl_s=READER_TTL, max_ttl_s=MAX_TTL)
    table.register_pool("p", 4)
    return table, clock


def reason_of(fn, *args) -> tuple[str, str]:
    with pytest.raises(LeaseError) as info:
        fn(*args)
    return info.value.kind, info.value.reason


def test_an_expired_reader_fences_grant_and_begin_write_before_any_sweep():
    table, clock = make()
    leases = table.grant("p", A, 1, 7)
    clock.now += READER_TTL - 0.01
    table.grant("p", B, 1, 7)  # still renewed in time: allowed
    clock.now += 0.02  # expired, and no sweep has run yet: the lease of A is still LEASED in the table
    assert table.pool_state("p")["num_leased"] == 2
    assert reason_of(table.grant, "p", b"c" * 16, 1, 7) == ("UNAVAILABLE", "POOL_FENCED")
    assert reason_of(table.begin_write, "p", A, 7, leases, "w", 1.0) == ("UNAVAILABLE", "POOL_FENCED")
    # nor can its decode bring it back: it may serve from another broker by now
    assert reason_of(table.reader_keep_alive, "p", [A, B]) == ("NOT_FOUND", "POOL_EXPIRED")
    assert reason_of(table.register_pool, "p", 4) == ("NOT_FOUND", "POOL_EXPIRED")


def test_a_writer_on_a_fenced_pool_gets_no_more_liveness():
    table, clock = make()
    leases = table.grant("p", A, 2, 7)
    table.keep_alive("w", 3.0)
    table.begin_write("p", A, 7, leases, "w", 1.0)
    table.keep_alive("w", 3.0)  # renewed while the pool's reader lives
    table.keep_alive("other", 3.0)
    clock.now += READER_TTL
    assert reason_of(table.keep_alive, "w", 3.0) == ("FAILED_PRECONDITION", "POOL_FENCED")
    table.keep_alive("other", 3.0)  # a writer of no fenced pool is unaffected
    assert table.fence_s == READER_TTL + MAX_TTL + LOCK_DELAY


def test_a_dead_pool_is_forgotten_only_once_nothing_is_held_then_late_calls_get_not_found():
    table, clock = make()
    leases = table.grant("p", A, 2, 7)
    table.begin_write("p", A, 7, leases, "w", 1.0)  # liveness: BeginWrite's default 4 s
    clock.now += READER_TTL
    table.sweep()  # revokes A: its pages are quarantined under the writer
    assert table.pool_state("p")["num_quarantined"] == 2
    clock.now += LOCK_DELAY
    assert table.forget_pools() == []  # fenced lock_delay ago, but a write may still land
    clock.now += 4.0 - READER_TTL + LOCK_DELAY + 0.01  # the writer's expiry + lock_delay passed
    table.sweep()
    assert table.pool_state("p")["num_free"] == 4
    assert table.forget_pools() == ["p"] and table.pool_ids() == []
    assert reason_of(table.reader_keep_alive, "p", []) == ("NOT_FOUND", "POOL_FORGOTTEN")
    # the id is never registered again: its generations would restart under the same (pool, epoch)
    assert reason_of(table.register_pool, "p", 4) == ("NOT_FOUND", "POOL_FORGOTTEN")
    assert reason_of(table.grant, "p", A, 1, 7)[1] == "UNKNOWN_POOL"


def test_memory_and_series_stay_bounded_across_decode_incarnations():
    clock = FakeClock()
    table = LeaseTable(lock_delay_s=LOCK_DELAY, default_writer_ttl_s=4.0, clock=clock, epoch=7,
                       reader_ttl_s=READER_TTL, max_ttl_s=MAX_TTL)
    registry = CollectorRegistry()
    servicer = BrokerServicer(table, registry=registry)
    sizes = []
    for n in range(200):
        pool = f"decode/d0/incarnation-{n}"
        table.register_pool(pool, 8)
        servicer._publish(pool)
        owner = n.to_bytes(16, "big")
        table.grant(pool, owner, 3, 7)
        table.revoke(pool, owner, "OPERATOR")  # some pages quarantined when the decode dies
        servicer._publish(pool)
        clock.now += READER_TTL + LOCK_DELAY + 0.1  # this incarnation stops renewing; the next starts
        table.sweep()
        servicer.forget_pools()
        series = {s.labels["pool"] for m in registry.collect() if m.name == "pdserve_kv_pages" for s in m.samples}
        sizes.append((len(table.pool_ids()), len(series), len(table._liveness)))
    assert max(sizes) <= (1, 1, 2), sizes[-5:]
    assert sizes[-1] == (0, 0, 0)


def test_a_stopping_broker_refuses_new_work_but_lets_leases_end():
    asyncio.run(_stopping())


async def _stopping():
    table = LeaseTable(epoch=5)
    async with serving(table) as (servicer, stub, _):
        await stub.RegisterPool(pb.RegisterPoolRequest(pool_id="p", num_pages=4, region=REGION))
        grant = await stub.Grant(pb.GrantRequest(pool_id="p", owner=A, num_pages=1, epoch=5))
        servicer.stop_accepting()
        stopping = grpc.StatusCode.UNAVAILABLE, "BROKER_STOPPING"
        await refused(stub.Grant(pb.GrantRequest(pool_id="p", owner=B, num_pages=1, epoch=5)), *stopping)
        await refused(stub.BeginWrite(pb.BeginWriteRequest(pool_id="p", owner=A, epoch=5, leases=grant.leases,
                                                           writer_id="w", max_landing_ms=500)), *stopping)
        await refused(stub.KeepAlive(pb.KeepAliveRequest(holder_id="w", ttl_ms=500)), *stopping)
        await refused(stub.RegisterPool(pb.RegisterPoolRequest(pool_id="q", num_pages=4, region=REGION)), *stopping)
        assert (await stub.Release(pb.ReleaseRequest(pool_id="p", owner=A, epoch=5))).num_freed == 1
        # the fence a moving decode must wait out, as announced
        assert table.pool_state("p")["num_free"] == 4 and servicer._fence_ms() == round(table.fence_s * 1000)


def test_keep_alive_of_an_unknown_pool_is_not_found_with_its_fence_announced_otherwise():
    asyncio.run(_announced())


async def _announced():
    table = LeaseTable(epoch=5, reader_ttl_s=1.0, max_ttl_s=3.0, default_writer_ttl_s=3.0, lock_delay_s=2.0)
    async with serving(table) as (_, stub, _):
        reg = await stub.RegisterPool(pb.RegisterPoolRequest(pool_id="p", num_pages=4, region=REGION))
        assert reg.fence_ms == 6000
        ka = await stub.KeepAlive(pb.KeepAliveRequest(holder_id="p", ttl_ms=500, pool_id="p"))
        assert (ka.epoch, ka.fence_ms) == (5, 6000)
        await refused(stub.KeepAlive(pb.KeepAliveRequest(holder_id="x", ttl_ms=500, pool_id="x")),
                      grpc.StatusCode.NOT_FOUND, "UNKNOWN_POOL")
