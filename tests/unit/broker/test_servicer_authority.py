"""The broker servicer under an election (authority.py), over a real gRPC channel: every answer carries the term it
was given under; once the term is over, every call is refused NOT_LEADER before the table acts (counted), and the
revocation stream ends; a caller that has seen a newer term is refused as an overlap."""
from __future__ import annotations

import asyncio

import grpc

from pdserve.broker.authority import ElectedAuthority
from pdserve.broker.lease_table import LeaseTable
from pdserve.common.proto import broker_pb2 as pb, common_pb2
from tests.unit.broker.test_authority import Scripted
from tests.unit.broker.test_servicer import OWNER, REGION, refused, serving

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def refusals(registry, reason: str) -> float | None:
    return registry.get_sample_value("pdserve_broker_not_leader_total", {"reason": reason})


def test_answers_carry_the_term_and_end_with_it():
    async def main():
        election = Scripted()
        election.term, election.leads = 17, True
        table = LeaseTable()
        authority = ElectedAuthority(election)
        authority.begin(17)
        async with serving(table, authority) as (servicer, stub, registry):
            reg = await stub.RegisterPool(pb.RegisterPoolRequest(pool_id="p", num_pages=4, region=REGION))
            grant = await stub.Grant(pb.GrantRequest(pool_id="p", owner=OWNER, num_pages=2, epoch=reg.epoch))
            ka = await stub.KeepAlive(pb.KeepAliveRequest(holder_id="p", ttl_ms=5000, pool_id="p", term_seen=17))
            assert (reg.term, grant.term, ka.term) == (17, 17, 17)
            stream = stub.WatchRevocations(pb.WatchRevocationsRequest(pool_id="p"))
            first = await stream.read()
            assert first.heartbeat and first.term == 17
            assert refusals(registry, "NOT_LEADER") == 0
            # a caller that has heard of term 18: another replica led while this one still believed it did
            await refused(stub.Grant(pb.GrantRequest(pool_id="p", owner=b"x" * 16, num_pages=1, epoch=reg.epoch,
                                                     term_seen=18)), UNAVAILABLE, "NOT_LEADER")
            assert refusals(registry, "TERM_OVERLAP") == 1
            assert table.pool_state("p")["num_leased"] == 2  # refused before the table acted
            election.leads = False  # the term is over
            await refused(stub.Grant(pb.GrantRequest(pool_id="p", owner=b"y" * 16, num_pages=1, epoch=reg.epoch)),
                          UNAVAILABLE, "NOT_LEADER")
            await refused(stub.Release(pb.ReleaseRequest(pool_id="p", owner=OWNER, epoch=reg.epoch)),
                          UNAVAILABLE, "NOT_LEADER")
            await refused(stub.GetPoolState(pb.GetPoolStateRequest(pool_id="p")), UNAVAILABLE, "NOT_LEADER")
            assert table.pool_state("p")["num_leased"] == 2 and refusals(registry, "NOT_LEADER") == 3
            # the stream's next heartbeat is refused instead: it ends
            try:
                await asyncio.wait_for(stream.read(), 5)
                raise AssertionError("the stream went on after the term ended")
            except grpc.aio.AioRpcError as e:
                assert e.code() == UNAVAILABLE
            election.term, election.leads = 30, True  # a new term does not revive this table
            await refused(stub.GetPoolState(pb.GetPoolStateRequest(pool_id="p")), UNAVAILABLE, "NOT_LEADER")
    asyncio.run(main())


def test_a_write_naming_a_pool_a_new_leader_has_not_adopted_yet_is_refused_without_a_violation():
    async def main():
        election = Scripted()
        election.term, election.leads = 17, True
        authority = ElectedAuthority(election)
        authority.begin(17)
        async with serving(LeaseTable(epoch=9), authority) as (_, stub, registry):
            await refused(stub.BeginWrite(pb.BeginWriteRequest(
                pool_id="p", owner=OWNER, epoch=9, leases=[common_pb2.PageLease(page=0, generation=3)],
                writer_id="w", max_landing_ms=1000)), grpc.StatusCode.NOT_FOUND, "UNKNOWN_POOL")
            counted = {s.labels["reason"]: s.value for m in registry.collect()
                       if m.name == "pdserve_lease_violations" for s in m.samples if s.name.endswith("_total")}
            assert counted.get("UNKNOWN_POOL", 0) == 0 and sum(counted.values()) == 0, counted
    asyncio.run(main())
