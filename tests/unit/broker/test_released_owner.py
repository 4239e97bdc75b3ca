"""A BeginWrite that comes after decode released its request (the client left while prefill's BeginWrite, which
overlaps the forward pass, was on its way) is refused, and is no lease violation: the critical alert must not
fire because a client hung up. A write for a revoked request, or one naming a page another request holds now at
that generation, is still refused and counted. The real LeaseTable behind the real broker servicer."""
import asyncio

from pdserve.broker.lease_table import LeaseTable
from pdserve.common.proto import broker_pb2 as pb, common_pb2
from tests.unit.broker.test_servicer import FAILED_PRECONDITION, REGION, refused, serving, violations
from tests.unit.decode.test_recheck import POOL, table_with_shares
from tests.unit.decode.test_recheck import A as A_PUBLISHER, B as B_SHARER, C as C_OWN

A, B, C = bytes(range(16)), bytes(range(1, 17)), bytes(range(2, 18))


def begin(stub, owner: bytes, epoch: int, leases):
    return stub.BeginWrite(pb.BeginWriteRequest(pool_id="d0", owner=owner, epoch=epoch, leases=leases,
                                                writer_id=f"prefill-0/{owner.hex()}", max_landing_ms=1000))


def counted(registry) -> float:
    return sum(violations(registry, r) or 0 for r in ("LEASE_NOT_CURRENT", "WRITER_ACTIVE", "LEASE_ALREADY_WRITTEN"))


def test_a_write_after_its_release_is_refused_uncounted_and_after_a_revocation_counted():
    async def main():
        async with serving() as (_, stub, registry):
            epoch = (await stub.RegisterPool(pb.RegisterPoolRequest(pool_id="d0", num_pages=4, region=REGION))).epoch
            a = (await stub.Grant(pb.GrantRequest(pool_id="d0", owner=A, num_pages=2, epoch=epoch))).leases
            await stub.Release(pb.ReleaseRequest(pool_id="d0", owner=A, epoch=epoch))
            err = await refused(begin(stub, A, epoch, a), FAILED_PRECONDITION, "OWNER_RELEASED")
            assert A.hex() in err.message and "FREE at generation" in err.message, err.message
            # still refused once the pages went to another request at a new generation; no alarm either
            b = (await stub.Grant(pb.GrantRequest(pool_id="d0", owner=B, num_pages=4, epoch=epoch))).leases
            assert {x.page for x in a} <= {x.page for x in b}
            await refused(begin(stub, A, epoch, a), FAILED_PRECONDITION, "OWNER_RELEASED")
            assert counted(registry) == 0
            # a released owner naming a page another request holds at that very generation: a forged write, counted
            await refused(begin(stub, A, epoch, b[:1]), FAILED_PRECONDITION, "LEASE_NOT_CURRENT")
            assert counted(registry) == 1
            # a revoked request's late write: counted, as before
            await stub.Release(pb.ReleaseRequest(pool_id="d0", owner=B, epoch=epoch))
            c = (await stub.Grant(pb.GrantRequest(pool_id="d0", owner=C, num_pages=2, epoch=epoch))).leases
            await stub.Revoke(pb.RevokeRequest(pool_id="d0", owner=C, reason="TEST"))
            await refused(begin(stub, C, epoch, c), FAILED_PRECONDITION, "LEASE_NOT_CURRENT")
            assert counted(registry) == 2
    asyncio.run(main())


def test_an_owner_decode_no_longer_lists_counts_as_released():
    """A Release that was lost: the broker revokes the owner decode's KeepAlive no longer names (NOT_HELD), and the
    late write of that request is no alarm either."""
    now = [100.0]
    async def main():
        async with serving(LeaseTable(clock=lambda: now[0], reconcile_grace_s=1.0)) as (_, stub, registry):
            epoch = (await stub.RegisterPool(pb.RegisterPoolRequest(pool_id="d0", num_pages=4, region=REGION))).epoch
            a = (await stub.Grant(pb.GrantRequest(pool_id="d0", owner=A, num_pages=2, epoch=epoch))).leases
            now[0] += 2.0
            await stub.KeepAlive(pb.KeepAliveRequest(holder_id="d0", ttl_ms=5000, pool_id="d0"))
            assert (await stub.GetPoolState(pb.GetPoolStateRequest(pool_id="d0"))).num_leased == 0
            await refused(begin(stub, A, epoch, a), FAILED_PRECONDITION, "OWNER_RELEASED")
            assert counted(registry) == 0
    asyncio.run(main())


def test_a_recheck_that_arrives_after_its_request_finished_is_no_violation():
    """Decode re-checks what runs after its revocation stream reconnects; a request that finishes meanwhile is
    released before its Validate lands. Its own page and the pages it shares then fail the check, as
    OWNER_RELEASED: not counted."""
    table, leases = table_with_shares()
    async def main():
        async with serving(table) as (_, stub, registry):
            for owner in (A_PUBLISHER, B_SHARER):
                table.release(POOL, owner, table.epoch)
                err = await refused(stub.Validate(pb.ValidateRequest(
                    pool_id=POOL, owner=owner, epoch=table.epoch, recheck=True,
                    leases=[common_pb2.PageLease(page=p, generation=g) for p, g in leases[owner]])),
                    FAILED_PRECONDITION, "OWNER_RELEASED")
                assert "CACHED" in err.message, err.message  # its first page: cached, this owner no reader any more
            assert counted(registry) == 0
            # the same check for a request decode never released (C still holds its page, at another generation)
            await refused(stub.Validate(pb.ValidateRequest(pool_id=POOL, owner=C_OWN, epoch=table.epoch, recheck=True,
                                                           leases=[common_pb2.PageLease(page=p, generation=g + 1)
                                                                   for p, g in leases[C_OWN]])),
                          FAILED_PRECONDITION, "LEASE_NOT_CURRENT")
            assert counted(registry) == 1
    asyncio.run(main())
