"""Decode's lease re-check after its revocation stream reconnects (watch.recheck_leases) against the real lease
table behind the real broker servicer on a real port: what a running request holds passes (its own pages as
LEASED, the pages it shares or published as CACHED with it among the readers), what the broker really ended fails
closed and is counted, and a re-check that cannot be made ends its request retryable without counting a
violation."""
import asyncio

import grpc
from prometheus_client import REGISTRY

from pdserve.broker.lease_table import LeaseTable, PageState
from pdserve.common.proto import broker_pb2_grpc
from pdserve.decode.scheduler import Sequence
from pdserve.decode.watch import BrokerWatch
from pdserve.engine.sampler import SamplingParams
from pdserve.engine.tags import expected_tags

from ..broker.test_lease_table import FakeClock
from ..broker.test_servicer import serving
from .test_watch_killed import Holder

A, B, C, D = (bytes([i]) * 16 for i in b"abcd")
K = [bytes([0xC0 + i]) * 16 for i in range(4)]
TAG = b"t" * 8
POOL = "decode/d0/p-00000000"
LOCK_DELAY = 2.0


def table_with_shares(clock=None) -> tuple[LeaseTable, dict[bytes, list[tuple[int, int]]]]:
    """A publishes its first two pages (they turn CACHED, A their first reader); B shares them; C holds its own."""
    table = LeaseTable(lock_delay_s=LOCK_DELAY, reader_ttl_s=float("inf"), reconcile_grace_s=1e9,
                       **({"clock": clock} if clock else {}))
    epoch = table.epoch
    table.register_pool(POOL, 8)
    leases = {}
    leases[A] = table.grant(POOL, A, 3, epoch)
    table.begin_write(POOL, A, epoch, leases[A], "w", 1.0)
    table.end_write(POOL, A, epoch, leases[A], "w", True)
    assert table.publish(POOL, A, epoch, leases[A][:2], K[:2], [1, 2], TAG) == [True, True]
    leases[B], num_shared, _ = table.grant_with_prefix(POOL, B, 3, epoch, K[:2], TAG)
    assert num_shared == 2 and leases[B][:2] == leases[A][:2]
    leases[C] = table.grant(POOL, C, 1, epoch)
    table.begin_write(POOL, C, epoch, leases[C], "w", 1.0)
    table.end_write(POOL, C, epoch, leases[C], "w", True)
    return table, leases


def running(holder: Holder, owner: bytes, epoch: int, leases: list[tuple[int, int]]) -> Sequence:
    seq = Sequence(owner, epoch, leases, expected_tags(owner, epoch, leases), 40, SamplingParams(max_tokens=8),
                   frozenset(), [1])
    holder.scheduler.join(seq)
    holder.scheduler.add(seq)
    return seq


def ended_and_released(holder: Holder, owner: bytes) -> None:
    holder.requests.finish(owner)
    holder.requests.forget(owner)


def count(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def violations() -> float:
    return count("pdserve_lease_violations_total", {"service": "decode", "reason": "REVOKED"})


def test_publisher_and_sharer_pass_the_recheck_and_a_share_that_ended_fails_it():
    async def main():
        clock = FakeClock()
        table, leases = table_with_shares(clock)
        async with serving(table) as (_, stub, registry):
            holder = Holder()
            watch = BrokerWatch(stub, holder, POOL, 8, 1.0, 2.0)
            seqs = {o: running(holder, o, table.epoch, leases[o]) for o in (A, B, C)}
            before = violations(), count("pdserve_lease_rechecks_total", {"outcome": "current"})
            await watch.recheck_leases()
            for owner, seq in seqs.items():
                assert not seq.cancelled and seq.err is None, (owner, seq.err)
            assert violations() == before[0]
            assert count("pdserve_lease_rechecks_total", {"outcome": "current"}) == before[1] + 3
            assert registry.get_sample_value("pdserve_lease_violations_total",
                                             {"service": "broker", "reason": "LEASE_NOT_CURRENT"}) in (None, 0.0)

            # B's share is revoked, and decode missed it (a gap in its stream): the pages are still CACHED, at the
            # same generation, but B is no longer among their readers
            table.revoke(POOL, B, "operator")
            await watch.recheck_leases()
            b = seqs[B]
            assert b.cancelled and (b.err.code, b.err.reason) == (grpc.StatusCode.DATA_LOSS, "REVOKED"), b.err
            assert "LEASE_NOT_CURRENT" in b.err.message and "is CACHED at generation 1" in b.err.message
            assert not seqs[A].cancelled and not seqs[C].cancelled
            assert violations() == before[0] + 1
            await watch.recheck_leases()  # B is ending: not asked again, not counted again
            assert violations() == before[0] + 1

            # the shared pages change hands: A ends, decode acknowledges B's revocation, lock_delay passes, and the
            # unread pages are evicted for D's grant, which takes them at a new generation. A decode that still
            # read them as B (one that missed all of it) fails its re-check
            ended_and_released(holder, A)
            table.release(POOL, A, table.epoch)
            table.reader_keep_alive(POOL, [C], table.last_seq(POOL))
            clock.now += LOCK_DELAY + 0.1
            table.sweep()
            d = table.grant(POOL, D, 7, table.epoch)
            shared_pages = {p for p, _ in leases[B][:2]}
            assert shared_pages <= {p for p, _ in d}
            assert all(table.page_info(POOL, p).state is PageState.LEASED for p in shared_pages)
            ended_and_released(holder, B)
            stale = running(holder, B, table.epoch, leases[B])
            await watch.recheck_leases()
            assert (stale.err.code, stale.err.reason) == (grpc.StatusCode.DATA_LOSS, "REVOKED"), stale.err
            assert "is LEASED at generation" in stale.err.message
            assert not seqs[C].cancelled
    asyncio.run(main())


def test_a_recheck_the_broker_cannot_answer_ends_requests_retryable_and_counts_no_violation():
    async def main():
        table, leases = table_with_shares()
        # nothing listens there: every call answers UNAVAILABLE
        async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:
            holder = Holder()
            watch = BrokerWatch(broker_pb2_grpc.BrokerStub(channel), holder, POOL, 8, 1.0, 0.5)
            seqs = [running(holder, o, table.epoch, leases[o]) for o in (A, B)]
            before = violations(), count("pdserve_lease_rechecks_total", {"outcome": "unreachable"})
            await watch.recheck_leases()
            for seq in seqs:
                assert seq.cancelled and (seq.err.code, seq.err.reason) == (grpc.StatusCode.UNAVAILABLE,
                                                                            "RECHECK_FAILED"), seq.err
                assert "did not answer" in seq.err.message
            assert violations() == before[0]
            assert count("pdserve_lease_rechecks_total", {"outcome": "unreachable"}) == before[1] + 2
    asyncio.run(main())
