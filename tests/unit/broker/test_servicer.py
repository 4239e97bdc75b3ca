"""The broker over a real gRPC channel: codes, ErrorInfo reasons, metrics, the revocation stream, the sweeper, and
hostile callers behind the authorisation interceptor."""
import asyncio
import contextlib

import grpc
import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from pdserve.broker.lease_table import LeaseTable
from pdserve.broker.servicer import BrokerServicer
from pdserve.common.authz import AuthInterceptor
from pdserve.common.errors import from_rpc_error
from pdserve.common.pki import make_pki
from pdserve.common.proto import broker_pb2 as pb, broker_pb2_grpc, common_pb2
from pdserve.common.server import ErrorInterceptor
from pdserve.common.tls import TlsConfig, secure_channel

OWNER = bytes(range(16))
REGION = pb.PoolRegion(transfer_session="127.0.0.1:9", data_base=0x1000, tag_base=0x2000)
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


class FakeClock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def serving(table: LeaseTable | None = None, authority=None):
    registry = CollectorRegistry()
    servicer = BrokerServicer(table or LeaseTable(), registry=registry, authority=authority)
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])  # a stream's PdError becomes its status
    broker_pb2_grpc.add_BrokerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield servicer, broker_pb2_grpc.BrokerStub(channel), registry
    finally:
        await server.stop(None)


async def refused(call, code: grpc.StatusCode, reason: str):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    err = from_rpc_error(info.value)
    assert (err.code, err.reason) == (code, reason), err
    return err


def pages(registry: CollectorRegistry, pool: str) -> dict[str, float]:
    return {s: registry.get_sample_value("pdserve_kv_pages", {"pool": pool, "state": s})
            for s in ("free", "leased", "quarantined")}


def violations(registry: CollectorRegistry, reason: str) -> float | None:
    return registry.get_sample_value("pdserve_lease_violations_total", {"service": "broker", "reason": reason})


async def eventually(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def next_revocation(call):
    while (msg := await asyncio.wait_for(call.read(), 5)).heartbeat:
        pass
    return msg


def test_metrics_exist_at_zero_from_start_up():
    async def main():
        async with serving() as (_, stub, registry):
            assert registry.get_sample_value("pdserve_broker_grants_total") == 0
            assert [violations(registry, r) for r in ("LEASE_NOT_CURRENT", "WRITER_ACTIVE")] == [0, 0]
            await stub.RegisterPool(pb.RegisterPoolRequest(pool_id="d0", num_pages=4, region=REGION))
            assert pages(registry, "d0") == {"free": 4, "leased": 0, "quarantined": 0}
    asyncio.run(main())


def test_write_quarantine_and_abort_ack_round_trip():
    async def main():
        async with serving() as (_, stub, registry):
            epoch = (await stub.RegisterPool(pb.RegisterPoolRequest(pool_id="d0", num_pages=4, region=REGION))).epoch
            granted = await stub.Grant(pb.GrantRequest(pool_id="d0", owner=OWNER, num_pages=3, epoch=epoch))
            assert granted.epoch == epoch
            assert [(lease.page, lease.generation) for lease in granted.leases] == [(0, 1), (1, 1), (2, 1)]
            assert pages(registry, "d0") == {"free": 1, "leased": 3, "quarantined": 0}
            assert registry.get_sample_value("pdserve_broker_grants_total") == 1
            leases = granted.leases[:2]
            began = await stub.BeginWrite(pb.BeginWriteRequest(pool_id="d0", owner=OWNER, epoch=epoch, leases=leases,
                                                       writer_id="prefill-0", max_landing_ms=1000))
            assert began.region == REGION  # the writer gets the registered addresses, whatever it was told
            await refused(stub.Validate(pb.ValidateRequest(pool_id="d0", owner=OWNER, epoch=epoch, leases=leases)),
                          FAILED_PRECONDITION, "WRITER_ACTIVE")
            assert violations(registry, "WRITER_ACTIVE") == 1
            released = await stub.Release(pb.ReleaseRequest(pool_id="d0", owner=OWNER, epoch=epoch))
            assert (released.num_freed, released.num_quarantined) == (1, 2)
            state = await stub.GetPoolState(pb.GetPoolStateRequest(pool_id="d0"))
            assert (state.epoch, state.num_pages, state.num_free, state.num_leased, state.num_quarantined,
                    state.num_writing) == (epoch, 4, 2, 0, 2, 2)
            assert pages(registry, "d0") == {"free": 2, "leased": 0, "quarantined": 2}
            # a write for a request its decode released (its caller left) is refused, and is no violation
            await refused(stub.BeginWrite(pb.BeginWriteRequest(pool_id="d0", owner=OWNER, epoch=epoch,
                                                               leases=leases, writer_id="prefill-0", max_landing_ms=1000)),
                          FAILED_PRECONDITION, "OWNER_RELEASED")
            assert violations(registry, "LEASE_NOT_CURRENT") == 0
            ack = pb.EndWriteRequest(pool_id="d0", owner=OWNER, epoch=epoch, leases=leases, writer_id="prefill-0",
                                     success=True)
            assert (await stub.EndWrite(ack)).num_unquarantined == 2
            assert (await stub.EndWrite(ack)).num_unquarantined == 0  # a duplicate ack is harmless
            assert pages(registry, "d0") == {"free": 4, "leased": 0, "quarantined": 0}
    asyncio.run(main())


def test_refusals_carry_code_reason_and_numbers():
    async def main():
        async with serving(LeaseTable(epoch=5)) as (_, stub, registry):
            await stub.RegisterPool(pb.RegisterPoolRequest(pool_id="d0", num_pages=4, region=REGION))
            err = await refused(stub.Grant(pb.GrantRequest(pool_id="d0", owner=OWNER, num_pages=5, epoch=5)),
                                grpc.StatusCode.RESOURCE_EXHAUSTED, "POOL_EXHAUSTED")
            assert "4 free pages of 4; 5 requested" in err.message
            await refused(stub.Grant(pb.GrantRequest(pool_id="d0", owner=OWNER, num_pages=1, epoch=6)),
                          FAILED_PRECONDITION, "EPOCH_MISMATCH")
            await refused(stub.Grant(pb.GrantRequest(pool_id="d9", owner=OWNER, num_pages=1, epoch=5)),
                          grpc.StatusCode.NOT_FOUND, "UNKNOWN_POOL")
            await refused(stub.Grant(pb.GrantRequest(pool_id="d0", owner=b"x", num_pages=1, epoch=5)),
                          grpc.StatusCode.INVALID_ARGUMENT, "BAD_OWNER")
            await refused(stub.RegisterPool(pb.RegisterPoolRequest(pool_id="d0", num_pages=8, region=REGION)),
                          grpc.StatusCode.ALREADY_EXISTS, "POOL_SIZE_MISMATCH")
            await refused(stub.KeepAlive(pb.KeepAliveRequest(holder_id="w", ttl_ms=0)),
                          grpc.StatusCode.INVALID_ARGUMENT, "BAD_KEEP_ALIVE")
            assert (await stub.KeepAlive(pb.KeepAliveRequest(holder_id="w", ttl_ms=500))).epoch == 5
            await refused(stub.Validate(pb.ValidateRequest(pool_id="d0", owner=OWNER, epoch=6)),
                          FAILED_PRECONDITION, "EPOCH_MISMATCH")
            assert violations(registry, "EPOCH_MISMATCH") == 1
            stream = stub.WatchRevocations(pb.WatchRevocationsRequest(pool_id="d9"))
            await refused(stream.read(), grpc.StatusCode.NOT_FOUND, "UNKNOWN_POOL")
            state = await stub.GetPoolState(pb.GetPoolStateRequest(pool_id="d0"))
            assert (state.num_free, state.num_leased) == (4, 0)
    asyncio.run(main())


def test_revocations_stream_to_every_watcher_of_the_pool():
    async def main():
        async with serving(LeaseTable(epoch=5)) as (servicer, stub, registry):
            for pool_id in ("d0", "d1"):
                await stub.RegisterPool(pb.RegisterPoolRequest(pool_id=pool_id, num_pages=4, region=REGION))
            await stub.Grant(pb.GrantRequest(pool_id="d0", owner=OWNER, num_pages=2, epoch=5))
            watchers = [stub.WatchRevocations(pb.WatchRevocationsRequest(pool_id="d0")) for _ in range(2)]
            other = stub.WatchRevocations(pb.WatchRevocationsRequest(pool_id="d1"))

            async def all_watching() -> bool:
                return (servicer.num_watchers("d0"), servicer.num_watchers("d1")) == (2, 1)
            await eventually(all_watching)
            assert servicer.revoke("d0", OWNER, "DECODE_DRAINING") == (0, 2)
            for call in watchers:
                event = await next_revocation(call)
                assert (event.owner, event.epoch, event.reason, event.seq) == (OWNER, 5, "DECODE_DRAINING", 1)
            assert pages(registry, "d0") == {"free": 2, "leased": 0, "quarantined": 2}
            with pytest.raises(asyncio.TimeoutError):  # the other pool's stream carries heartbeats only
                await asyncio.wait_for(next_revocation(other), 0.5)
            for call in [*watchers, other]:
                call.cancel()

            async def none_watching() -> bool:
                return servicer.num_watchers("d0") + servicer.num_watchers("d1") == 0
            await eventually(none_watching)
    asyncio.run(main())


def test_sweeper_frees_quarantine_after_liveness_expiry_plus_lock_delay():
    async def main():
        clock = FakeClock()
        async with serving(LeaseTable(lock_delay_s=2.0, clock=clock, epoch=5)) as (servicer, stub, registry):
            await stub.RegisterPool(pb.RegisterPoolRequest(pool_id="d0", num_pages=2, region=REGION))
            leases = (await stub.Grant(pb.GrantRequest(pool_id="d0", owner=OWNER, num_pages=2, epoch=5))).leases
            await stub.KeepAlive(pb.KeepAliveRequest(holder_id="prefill-0", ttl_ms=1000))
            await stub.BeginWrite(pb.BeginWriteRequest(pool_id="d0", owner=OWNER, epoch=5, leases=leases,
                                                       writer_id="prefill-0", max_landing_ms=1000))
            await stub.Release(pb.ReleaseRequest(pool_id="d0", owner=OWNER, epoch=5))
            sweeper = asyncio.create_task(servicer.run_sweeper(0.01))
            try:
                clock.now += 2.9  # expired 1.9 s ago: still inside the lock delay
                await asyncio.sleep(0.1)
                assert pages(registry, "d0") == {"free": 0, "leased": 0, "quarantined": 2}
                clock.now += 0.2

                async def all_free() -> bool:
                    return (await stub.GetPoolState(pb.GetPoolStateRequest(pool_id="d0"))).num_free == 2
                await eventually(all_free)
                assert pages(registry, "d0") == {"free": 2, "leased": 0, "quarantined": 0}
            finally:
                sweeper.cancel()
    asyncio.run(main())


def test_stale_acks_and_releases_from_an_earlier_incarnation_are_harmless_no_ops():
    """After a broker restart, writers and readers of the old epoch still send EndWrite and Release for
    pools this incarnation has never seen: both must succeed as no-ops, not fail."""
    async def main():
        async with serving(LeaseTable(epoch=9)) as (_, stub, _registry):
            lease = [common_pb2.PageLease(page=0, generation=1)]
            r = await stub.EndWrite(pb.EndWriteRequest(pool_id="gone", owner=OWNER, epoch=4, leases=lease,
                                                       writer_id="w", success=False))
            assert r.num_unquarantined == 0
            r = await stub.Release(pb.ReleaseRequest(pool_id="gone", owner=OWNER, epoch=4))
            assert (r.num_freed, r.num_quarantined) == (0, 0)
    asyncio.run(main())


# --- hostile callers behind the real authorisation interceptor (mutual TLS, one certificate per instance) ------

IDS = ["broker/b0", "decode/d0", "decode/d1", "prefill/p0", "prefill/p1", "operator/o"]
POOL = "decode/d0/127.0.0.1-1-2-ab"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    files = make_pki(str(tmp_path_factory.mktemp("pki")), IDS)
    return {i: TlsConfig(f.cert, f.key, f.ca) for i, f in files.items()}


@contextlib.asynccontextmanager
async def serving_tls(pki, table: LeaseTable):
    """The broker as main.py serves it; yields one stub per identity."""
    server = grpc.aio.server(interceptors=[AuthInterceptor("broker-unit", ["pdserve.v1.Broker"]),
                                           ErrorInterceptor()])
    broker_pb2_grpc.add_BrokerServicer_to_server(BrokerServicer(table, registry=CollectorRegistry()), server)
    port = server.add_secure_port("127.0.0.1:0", pki["broker/b0"].server_credentials())
    await server.start()
    channels = {i: secure_channel(f"127.0.0.1:{port}", pki[i]) for i in IDS[1:]}
    try:
        yield {i: broker_pb2_grpc.BrokerStub(ch) for i, ch in channels.items()}
    finally:
        for ch in channels.values():
            await ch.close()
        await server.stop(None)


def auth_denials(method: str) -> float:
    return REGISTRY.get_sample_value("pdserve_auth_denials_total",
                                     {"service": "broker-unit", "method": method, "reason": "NOT_OWN_RESOURCE"})


async def outcome(call):
    """The call's error, or None when it succeeded: the effects are checked first, the refusals after."""
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return from_rpc_error(e)
    return None


def assert_refused(err, *shown: str) -> None:
    assert err is not None, "the hostile call was accepted"
    assert (err.code, err.reason) == (grpc.StatusCode.PERMISSION_DENIED, "NOT_OWN_RESOURCE"), err
    assert all(s in err.message for s in shown), err.message


def test_no_keepalive_but_its_decodes_own_reconciles_or_renews_a_pool(pki):
    """A prefill's or another decode's KeepAlive naming pool_id would revoke the pool's owners missing from its
    held_owners (NOT_HELD) and renew the pool's reader, so that a decode that stopped renewing it is never fenced."""
    async def main():
        clock = FakeClock()
        table = LeaseTable(clock=clock, epoch=5, reader_ttl_s=5.0, reconcile_grace_s=1.0)
        async with serving_tls(pki, table) as stubs:
            d0 = stubs["decode/d0"]
            await d0.RegisterPool(pb.RegisterPoolRequest(pool_id=POOL, num_pages=4, region=REGION))
            leases = (await d0.Grant(pb.GrantRequest(pool_id=POOL, owner=OWNER, num_pages=2, epoch=5))).leases
            clock.now += 2.0  # the owner is past the reconcile grace: a KeepAlive not listing it revokes it
            denied = auth_denials("KeepAlive")
            hostile = [
                (await outcome(stubs["prefill/p0"].KeepAlive(pb.KeepAliveRequest(
                    holder_id="prefill/p0/w", ttl_ms=1000, pool_id=POOL))), ("pool_id", repr(POOL))),
                (await outcome(stubs["prefill/p0"].KeepAlive(pb.KeepAliveRequest(
                    holder_id="prefill/p0/w", ttl_ms=1000, pool_id=POOL, held_owners=[OWNER]))), ("pool_id",)),
                (await outcome(stubs["prefill/p0"].KeepAlive(pb.KeepAliveRequest(
                    holder_id="prefill/p0/w", ttl_ms=1000, held_owners=[OWNER]))), ("held_owners", OWNER.hex())),
                (await outcome(stubs["decode/d1"].KeepAlive(pb.KeepAliveRequest(
                    holder_id="decode/d1/x", ttl_ms=1000, pool_id=POOL))), ("pool_id", repr(POOL)))]
            assert table.leases_of(POOL, OWNER) == [(lease.page, lease.generation) for lease in leases]
            assert table.last_seq(POOL) == 0  # nothing revoked, so nothing on the pool's stream
            await d0.Validate(pb.ValidateRequest(pool_id=POOL, owner=OWNER, epoch=5, leases=leases))
            clock.now += 3.5  # 5.5 s since its decode last renewed it: fenced, whoever else asked to renew it
            await refused(d0.Grant(pb.GrantRequest(pool_id=POOL, owner=b"n" * 16, num_pages=1, epoch=5)),
                          grpc.StatusCode.UNAVAILABLE, "POOL_FENCED")
            for err, shown in hostile:
                assert_refused(err, *shown)
            assert auth_denials("KeepAlive") == denied + len(hostile)
    asyncio.run(main())


def test_no_caller_renews_another_writer_or_the_brokers_own_holders(pki):
    """Renewing a holder keeps the pages it holds in quarantine: another prefill's write, a failed write
    (failed/...), a revocation (revoked/...), pages of an earlier epoch (earlier-epoch/...)."""
    async def main():
        clock = FakeClock()
        table = LeaseTable(lock_delay_s=2.0, default_writer_ttl_s=1.0, clock=clock, epoch=5, reader_ttl_s=100.0)
        async with serving_tls(pki, table) as stubs:
            d0, p0, p1 = stubs["decode/d0"], stubs["prefill/p0"], stubs["prefill/p1"]
            await d0.RegisterPool(pb.RegisterPoolRequest(pool_id=POOL, num_pages=6, quarantined_pages=[0],
                                                         region=REGION))
            failed_owner, revoked_owner, other_owner = b"f" * 16, b"r" * 16, b"o" * 16
            leases = (await d0.Grant(pb.GrantRequest(pool_id=POOL, owner=failed_owner, num_pages=2, epoch=5))).leases
            write = dict(pool_id=POOL, owner=failed_owner, epoch=5, leases=leases, writer_id="prefill/p0/w1")
            await p0.BeginWrite(pb.BeginWriteRequest(**write, max_landing_ms=1000))
            await p0.EndWrite(pb.EndWriteRequest(**write, success=False))
            await d0.Release(pb.ReleaseRequest(pool_id=POOL, owner=failed_owner, epoch=5))
            await d0.Grant(pb.GrantRequest(pool_id=POOL, owner=revoked_owner, num_pages=1, epoch=5))
            await stubs["operator/o"].Revoke(pb.RevokeRequest(pool_id=POOL, owner=revoked_owner))
            leases = (await d0.Grant(pb.GrantRequest(pool_id=POOL, owner=other_owner, num_pages=1, epoch=5))).leases
            await p1.BeginWrite(pb.BeginWriteRequest(pool_id=POOL, owner=other_owner, epoch=5, leases=leases,
                                                     writer_id="prefill/p1/w", max_landing_ms=1000,
                                                     writer_ttl_ms=1000))
            await d0.Release(pb.ReleaseRequest(pool_id=POOL, owner=other_owner, epoch=5))
            assert (await d0.GetPoolState(pb.GetPoolStateRequest(pool_id=POOL))).num_quarantined == 5
            holders = [f"earlier-epoch/{POOL}", "failed/prefill/p0/w1", f"revoked/{POOL}/{revoked_owner.hex()}",
                       "prefill/p1/w"]
            denied = auth_denials("KeepAlive")
            hostile = [await outcome(p0.KeepAlive(pb.KeepAliveRequest(
                           holder_id="prefill/p0/h", ttl_ms=10_000, more_holder_ids=holders))),
                       await outcome(d0.KeepAlive(pb.KeepAliveRequest(
                           holder_id=POOL, ttl_ms=10_000, pool_id=POOL, more_holder_ids=holders)))]
            hostile += [await outcome(p0.KeepAlive(pb.KeepAliveRequest(holder_id=h, ttl_ms=10_000))) for h in holders]
            # the pool's own decode acknowledges the revocation (it holds nothing): lock_delay starts for those pages
            await d0.KeepAlive(pb.KeepAliveRequest(holder_id=POOL, ttl_ms=10_000, pool_id=POOL,
                                                   revocations_seen=table.last_seq(POOL)))
            clock.now += 3.1  # every holder is past its liveness (1 s at most) plus lock_delay (2 s)
            assert table.sweep() == 5
            state = await d0.GetPoolState(pb.GetPoolStateRequest(pool_id=POOL))
            assert (state.num_free, state.num_quarantined, state.num_writing) == (6, 0, 0)
            for err in hostile[:2]:
                assert_refused(err, "more_holder_ids", repr(holders[0]))
            for err, holder in zip(hostile[2:], holders):
                assert_refused(err, "holder_id", repr(holder))
            assert auth_denials("KeepAlive") == denied + len(hostile)
    asyncio.run(main())


def test_a_prefill_names_any_pool_but_acts_only_by_the_leases(pki):
    """BeginWrite's and EndWrite's pool_id and owner are not the prefill's: the lease table decides by the leases."""
    async def main():
        table = LeaseTable(epoch=5)
        async with serving_tls(pki, table) as stubs:
            d0, p0, p1 = stubs["decode/d0"], stubs["prefill/p0"], stubs["prefill/p1"]
            await d0.RegisterPool(pb.RegisterPoolRequest(pool_id=POOL, num_pages=4, region=REGION))
            leases = (await d0.Grant(pb.GrantRequest(pool_id=POOL, owner=OWNER, num_pages=2, epoch=5))).leases
            stale = [common_pb2.PageLease(page=lease.page, generation=lease.generation + 1) for lease in leases]
            for owner, named in ((b"x" * 16, leases), (OWNER, stale)):
                await refused(p0.BeginWrite(pb.BeginWriteRequest(pool_id=POOL, owner=owner, epoch=5, leases=named,
                                                                 writer_id="prefill/p0/w", max_landing_ms=1000)),
                              FAILED_PRECONDITION, "LEASE_NOT_CURRENT")
            write = dict(pool_id=POOL, owner=OWNER, epoch=5, leases=leases)
            await p1.BeginWrite(pb.BeginWriteRequest(**write, writer_id="prefill/p1/w", max_landing_ms=1000))
            # p0 cannot end p1's write: an ack undoes only its own writer id's BeginWrite
            assert (await p0.EndWrite(pb.EndWriteRequest(**write, writer_id="prefill/p0/w", success=True))) \
                .num_unquarantined == 0
            assert [table.page_info(POOL, lease.page).active_writer for lease in leases] == \
                [("prefill/p1/w", lease.generation) for lease in leases]
    asyncio.run(main())
