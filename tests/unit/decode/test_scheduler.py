"""The scheduler's hold on a request between Decode taking its allocation and the end: a revocation, Release
or broker restart that arrives while the request is still being verified is not lost, and a running one is
ended between steps, never by releasing its pages under a step."""
import asyncio

import grpc
import pytest

from pdserve.common.errors import PdError
from pdserve.common.metrics import LEASE_VIOLATIONS
from pdserve.decode.scheduler import Scheduler, Sequence, raise_if_ended
from pdserve.engine.sampler import SamplingParams
from pdserve.engine.tags import expected_tags

OWNER = bytes(range(16))
LEASES = [(3, 1), (4, 1)]
REVOKED = PdError(grpc.StatusCode.DATA_LOSS, "REVOKED", "the broker revoked this request's leases: TEST")


def _seq() -> Sequence:
    return Sequence(OWNER, 7, LEASES, expected_tags(OWNER, 7, LEASES), 5, SamplingParams(max_tokens=8), frozenset(), [1])


def test_every_end_of_sequence_id_ends_a_sequence():
    seq = Sequence(OWNER, 7, LEASES, expected_tags(OWNER, 7, LEASES), 5, SamplingParams(max_tokens=8),
                   frozenset({1, 9}), [4])
    assert not seq.is_finished()
    seq.generated.append(9)
    assert seq.is_stopped() and seq.is_finished()
    seq.sampling.ignore_eos = True
    assert not seq.is_finished()


def _scheduler(released: list) -> Scheduler:
    async def release(seq):
        released.append(seq.owner)
    return Scheduler(runner=None, release=release)


def _revoked_count() -> float:
    return LEASE_VIOLATIONS.labels("decode", "REVOKED")._value.get()


def test_revocation_while_joining_stops_the_start():
    async def main():
        released = []
        s, seq = _scheduler(released), _seq()
        s.join(seq)
        before = _revoked_count()
        s.revoke(OWNER, REVOKED)
        assert _revoked_count() == before + 1
        with pytest.raises(PdError) as e:
            raise_if_ended(seq)
        assert e.value.reason == "REVOKED"
        with pytest.raises(PdError) as e:
            s.add(seq)
        assert (e.value.code, e.value.reason) == (grpc.StatusCode.DATA_LOSS, "REVOKED")
        assert OWNER not in s.running and OWNER not in s.joining
        assert released == []  # the Decode call that joined it gives the pages back, once
    asyncio.run(main())


def test_release_while_joining_stops_the_start():
    async def main():
        s, seq = _scheduler([]), _seq()
        s.join(seq)
        s.cancel(OWNER)
        with pytest.raises(PdError) as e:
            s.add(seq)
        assert (e.value.code, e.value.reason) == (grpc.StatusCode.CANCELLED, "RELEASED")
    asyncio.run(main())


def test_broker_restart_fails_joining_and_running_alike():
    async def main():
        s = _scheduler([])
        running, joining = _seq(), Sequence(bytes(16), 7, [(9, 2)], expected_tags(bytes(16), 7, [(9, 2)]), 5,
                                            SamplingParams(max_tokens=8), frozenset(), [1])
        s.add(running)
        s.join(joining)
        s.fail_all(PdError(grpc.StatusCode.UNAVAILABLE, "BROKER_RESTARTED", "test"))
        assert running.err.reason == joining.err.reason == "BROKER_RESTARTED"
        with pytest.raises(PdError):
            s.add(joining)
    asyncio.run(main())


def test_revoking_a_running_sequence_only_marks_it():
    async def main():
        released = []
        s, seq = _scheduler(released), _seq()
        s.add(seq)
        s.revoke(OWNER, REVOKED)
        await asyncio.sleep(0)
        # a step may be using its pages right now: they go back when the loop ends it, between steps
        assert released == [] and s.running[OWNER] is seq and not seq.done
        assert seq.cancelled and seq.err is REVOKED
        s._end(seq, seq.err)  # what the loop's sweep does
        await asyncio.sleep(0)
        assert released == [OWNER] and seq.events.get_nowait() is REVOKED
    asyncio.run(main())


def test_a_request_unknown_to_the_scheduler_is_not_counted_as_revoked():
    s = _scheduler([])
    before = _revoked_count()
    s.revoke(OWNER, REVOKED)
    assert _revoked_count() == before
