"""The broker over a real gRPC channel: codes, ErrorInfo reasons, metrics, the revocation stream, the sweeper."""
import asyncio
import contextlib

import grpc
import pytest
from prometheus_client import CollectorRegistry

from pdserve.broker.lease_table import LeaseTable
from pdserve.broker.servicer import BrokerServicer
from pdserve.common.errors import from_rpc_error
from pdserve.common.proto import broker_pb2 as pb, broker_pb2_grpc, common_pb2

OWNER = bytes(range(16))
REGION = pb.PoolRegion(transfer_session="127.0.0.1:9", data_base=0x1000, tag_base=0x2000)
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


class FakeClock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def serving(table: LeaseTable | None = None):
    registry = CollectorRegistry()
    servicer = BrokerServicer(table or LeaseTable(), registry=registry)
    server = grpc.aio.server()
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
            await refused(stub.BeginWrite(pb.BeginWriteRequest(pool_id="d0", owner=OWNER, epoch=epoch,
                                                               leases=leases, writer_id="prefill-0", max_landing_ms=1000)),
                          FAILED_PRECONDITION, "LEASE_NOT_CURRENT")
            assert violations(registry, "LEASE_NOT_CURRENT") == 1
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
