"""Decode's allocation table has one owner (allocations.py): every allocation is handed out exactly once, to the
Decode/Run that takes it or to whoever ends it (expiry, drain, revocation, a move), never both (issue 18, hole 1);
a Run waiting for its notice reports why its allocation ended (hole 5); after a stream gap the lease re-check
covers joining requests as well as running ones."""
import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest

from pdserve.common.drain import draining_error
from pdserve.common.errors import PdError
from pdserve.decode.allocations import Allocation, Allocations
from pdserve.decode.run import GrantQueue, Notices
from pdserve.decode.scheduler import Scheduler, Sequence
from pdserve.decode.watch import BrokerWatch
from pdserve.engine.sampler import SamplingParams
from pdserve.engine.tags import expected_tags

LEASES = [(3, 1), (4, 1)]


def _alloc(deadline: float) -> Allocation:
    return Allocation(7, list(LEASES), 20, 8, deadline, "p")


def _seq(owner: bytes) -> Sequence:
    return Sequence(owner, 7, LEASES, expected_tags(owner, 7, LEASES), 5, SamplingParams(max_tokens=8), frozenset(),
                    [1])


class Broker:
    """The broker RPCs this module's code sends, recorded; Validate refuses the owners in `gone`."""

    def __init__(self, gone=()):
        self.asked, self.released, self.gone = [], [], set(gone)

    def Validate(self, req, timeout):
        self.asked.append(req.owner)
        return self._answer(req.owner in self.gone)

    def Release(self, req, timeout):
        self.released.append(req.owner)
        return self._answer(False)

    @staticmethod
    async def _answer(refuse: bool):
        if refuse:
            raise PdError(grpc.StatusCode.FAILED_PRECONDITION, "LEASE_NOT_CURRENT", "page 3 is FREE")
        return SimpleNamespace(term=0)


class Holder:
    """What BrokerWatch reaches of decode; release() waits on a gate, as an RPC would."""

    def __init__(self, broker=None):
        self.scheduler = Scheduler(runner=None, release=self._release_seq)
        self.requests = self.scheduler.requests
        self.allocations = self.requests.allocations
        self.released: list[bytes] = []
        self.gate = asyncio.Event()
        self.queue = GrantQueue()

    async def _release_seq(self, seq):
        self.released.append(seq.owner)

    async def release(self, owner, epoch, leases):
        await self.gate.wait()
        self.released.append(owner)


def test_expiry_pops_every_expired_allocation_at_once_so_one_taken_meanwhile_is_never_released():
    async def main():
        holder = Holder()
        watch = BrokerWatch(None, holder, "p", 8, 1.0, 1.0)
        past = time.monotonic() - 1
        a, b = _alloc(past), _alloc(past)
        holder.allocations.add(b"A" * 16, a)
        holder.allocations.add(b"B" * 16, b)
        holder.allocations.add(b"C" * 16, _alloc(time.monotonic() + 60))
        task = asyncio.create_task(watch.expire_allocations(interval_s=0.01))
        await asyncio.sleep(0.1)  # expiry now waits in A's Release
        # the old loop released a snapshot: Decode taking B here got B decoded and released at once
        assert holder.allocations.take(b"B" * 16) is None
        assert b"C" * 16 in holder.allocations
        holder.gate.set()
        await asyncio.sleep(0.1)
        task.cancel()
        return holder, a, b
    holder, a, b = asyncio.run(main())
    assert holder.released == [b"A" * 16, b"B" * 16]  # each once, by expiry alone
    assert (a.ended.code, a.ended.reason) == (grpc.StatusCode.DEADLINE_EXCEEDED, "NO_WRITE")
    assert len(holder.allocations) == 1


def test_an_allocation_taken_by_its_decode_is_never_ended_by_anyone_else():
    table = Allocations()
    alloc = table.add(b"o" * 16, _alloc(time.monotonic() - 1))
    assert table.take(b"o" * 16, alloc) is alloc
    assert table.expire() == [] and table.end(b"o" * 16, draining_error("decode", "x")) is None
    assert table.end_all(draining_error("decode", "x")) == [] and alloc.ended is None
    assert table.take(b"o" * 16) is None  # handed out once
    with pytest.raises(PdError) as e:
        table.add(b"p" * 16, alloc) and table.add(b"p" * 16, alloc)
    assert e.value.reason == "OWNER_HAS_LEASE"


@pytest.mark.parametrize("how,want", [
    ("drain", (grpc.StatusCode.UNAVAILABLE, "DRAINING")),
    ("expiry", (grpc.StatusCode.DEADLINE_EXCEEDED, "NO_WRITE")),
    ("revocation", (grpc.StatusCode.DATA_LOSS, "REVOKED")),
])
def test_a_run_waiting_for_its_notice_reports_why_its_allocation_ended(how, want):
    """The drain timeout or the expiry tick used to end the wait as DATA_LOSS REVOKED (HTTP 500, no retry)."""
    async def main():
        table, notices = Allocations(), Notices(16, lambda: None)
        alloc = table.add(b"o" * 16, _alloc(time.monotonic() + 0.05 if how == "expiry" else time.monotonic() + 60))
        fut = notices.expect(b"o" * 16)
        loop = asyncio.get_running_loop()
        if how == "drain":
            loop.call_later(0.05, table.end_all, draining_error("decode", "its 25s drain timeout ended this stream"))
        elif how == "expiry":
            # the expiry tick wins the race with the Run's own look at the deadline (0.05 s)
            loop.call_later(0.06, table.expire, time.monotonic() + 1)
            alloc.deadline = time.monotonic() + 0.5  # the Run's own bound comes later
        else:
            loop.call_later(0.05, table.end, b"o" * 16,
                            PdError(grpc.StatusCode.DATA_LOSS, "REVOKED", "the broker revoked: OPERATOR"))
        with pytest.raises(PdError) as e:
            await notices.wait(b"o" * 16, alloc, fut, None, b"d" * 16, 60.0)
        return e.value
    err = asyncio.run(main())
    assert (err.code, err.reason) == want


def test_after_a_stream_gap_the_recheck_fails_a_joining_request_whose_lease_is_gone():
    async def main():
        holder, broker = Holder(), Broker(gone=[b"j" * 16])
        watch = BrokerWatch(broker, holder, "p", 8, 1.0, 1.0)
        seqs = {}
        for o in (b"r" * 16, b"j" * 16):
            seqs[o] = _seq(o)
            holder.scheduler.join(seqs[o])
        holder.scheduler.add(seqs[b"r" * 16])
        await watch.recheck_leases()
        return broker, seqs
    broker, seqs = asyncio.run(main())
    assert sorted(broker.asked) == [b"j" * 16, b"r" * 16]
    joining = seqs[b"j" * 16]
    assert joining.cancelled and (joining.err.code, joining.err.reason) == (grpc.StatusCode.DATA_LOSS, "REVOKED")
    assert not seqs[b"r" * 16].cancelled


def test_decode_never_sends_a_release_for_an_owner_its_scheduler_still_steps(model_dir):
    """Defence in depth for hole 1: were some path to release an owner that is still joining or running, the
    broker would free its pages at once and re-grant them under the running step. Decode stops the sequence
    instead; the scheduler releases it between steps."""
    from pdserve.decode.servicer import DecodeServicer
    from pdserve.engine.runner import ModelRunner

    async def main():
        broker = Broker()
        runner = ModelRunner(model_dir, num_pages=8, page_size=16, device="cpu")
        servicer = DecodeServicer(runner, broker, "decode/d0/p", "session", 4096, "tiny")
        owner = b"r" * 16
        seq = _seq(owner)
        servicer.scheduler.join(seq)
        await servicer.release(owner, 7, LEASES)
        assert broker.released == [] and seq.cancelled and seq.err.reason == "RELEASE_WHILE_HELD"
        servicer.scheduler.leave(owner)
        await servicer.release(owner, 7, LEASES)
        assert broker.released == [owner]
    asyncio.run(main())
