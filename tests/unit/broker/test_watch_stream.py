"""The revocation stream over a real gRPC channel: numbered revocations, replay from a cursor on resubscribe,
an explicit gap when the log no longer holds everything after the cursor, heartbeats on an idle stream."""
import asyncio

from pdserve.broker.lease_table import LeaseTable
from pdserve.broker.revocation_log import RevocationLog
from pdserve.common.proto import broker_pb2 as pb
from tests.unit.broker.test_servicer import serving

OWNERS = [bytes([i]) * 16 for i in range(1, 7)]
EPOCH = 5


async def read_until_heartbeat(call) -> tuple[list, object]:
    """The revocations before the next heartbeat, and that heartbeat."""
    events = []
    while not (msg := await asyncio.wait_for(call.read(), 5)).heartbeat:
        events.append(msg)
    return events, msg


async def setup(stub, num_owners: int) -> None:
    await stub.RegisterPool(pb.RegisterPoolRequest(pool_id="d0", num_pages=8, region=pb.PoolRegion(
        transfer_session="127.0.0.1:9", data_base=0x1000, tag_base=0x2000)))
    for owner in OWNERS[:num_owners]:
        await stub.Grant(pb.GrantRequest(pool_id="d0", owner=owner, num_pages=1, epoch=EPOCH))


def test_resubscribe_replays_every_revocation_after_the_cursor():
    async def main():
        async with serving(LeaseTable(epoch=EPOCH)) as (servicer, stub, _):
            await setup(stub, 4)
            servicer.revoke("d0", OWNERS[0], "R0")  # before anyone watched
            call = stub.WatchRevocations(pb.WatchRevocationsRequest(pool_id="d0"))
            events, beat = await read_until_heartbeat(call)
            assert [(e.owner, e.seq, e.reason, e.epoch) for e in events] == [(OWNERS[0], 1, "R0", EPOCH)]
            assert (beat.seq, beat.gap, beat.epoch) == (1, False, EPOCH)
            servicer.revoke("d0", OWNERS[1], "R1")
            events, beat = await read_until_heartbeat(call)
            assert [(e.owner, e.seq) for e in events] == [(OWNERS[1], 2)] and beat.seq == 2
            call.cancel()
            # sent into a stream that is gone, or revoked while nobody watched: both come back on resume
            servicer.revoke("d0", OWNERS[2], "R2")
            servicer.revoke("d0", OWNERS[3], "R3")
            call = stub.WatchRevocations(pb.WatchRevocationsRequest(pool_id="d0", after_seq=2, epoch=EPOCH))
            events, beat = await read_until_heartbeat(call)
            assert [(e.owner, e.seq, e.reason) for e in events] == [(OWNERS[2], 3, "R2"), (OWNERS[3], 4, "R3")]
            assert (beat.seq, beat.gap) == (4, False)
            call.cancel()
            # a cursor of another epoch means nothing here: everything is replayed
            call = stub.WatchRevocations(pb.WatchRevocationsRequest(pool_id="d0", after_seq=3, epoch=EPOCH + 1))
            events, beat = await read_until_heartbeat(call)
            assert [e.seq for e in events] == [1, 2, 3, 4] and not beat.gap
            call.cancel()
    asyncio.run(main())


def test_a_truncated_log_is_flagged_as_a_gap_never_silently():
    async def main():
        table = LeaseTable(epoch=EPOCH)
        async with serving(table) as (servicer, stub, _):
            await setup(stub, 6)
            table._pools["d0"].revocations = RevocationLog(capacity=3)  # a small log, to overflow it
            for i in range(6):
                servicer.revoke("d0", OWNERS[i], f"R{i}")
            call = stub.WatchRevocations(pb.WatchRevocationsRequest(pool_id="d0", after_seq=1, epoch=EPOCH))
            events, beat = await read_until_heartbeat(call)
            assert [e.seq for e in events] == [4, 5, 6]  # 2 and 3 are gone, and the watcher is told so
            assert (beat.gap, beat.seq) == (True, 6)
            servicer.revoke("d0", OWNERS[0], "again")
            events, beat = await read_until_heartbeat(call)
            assert [e.seq for e in events] == [7] and not beat.gap
            call.cancel()
            call = stub.WatchRevocations(pb.WatchRevocationsRequest(pool_id="d0", after_seq=4, epoch=EPOCH))
            events, beat = await read_until_heartbeat(call)  # exactly what the log holds (5..7): no gap
            assert [e.seq for e in events] == [5, 6, 7] and not beat.gap
            call.cancel()
    asyncio.run(main())


def test_an_idle_stream_carries_heartbeats_with_the_current_seq():
    async def main():
        async with serving(LeaseTable(epoch=EPOCH)) as (servicer, stub, _):
            await setup(stub, 1)
            servicer.revoke("d0", OWNERS[0], "R0")
            call = stub.WatchRevocations(pb.WatchRevocationsRequest(pool_id="d0", after_seq=1, epoch=EPOCH))
            loop = asyncio.get_running_loop()
            start = loop.time()
            beats = [await read_until_heartbeat(call) for _ in range(4)]
            assert all(events == [] and beat.seq == 1 for events, beat in beats)
            assert loop.time() - start >= 3 * 0.25 * 0.9  # one at once, then one per interval
            call.cancel()
    asyncio.run(main())
