"""The reader fence on its own, with a pool and a liveness record and no lease table: it decides (stale owners,
acknowledgements, pools to forget) and changes only the reader records, the unacked revocations and the liveness
of their holders."""
import pytest

from pdserve.broker.liveness import Liveness
from pdserve.broker.pages import LeaseError, PoolPages
from pdserve.broker.reader_liveness import ReaderFence

from .test_lease_table import FakeClock

READER_TTL, GRACE, LOCK_DELAY = 5.0, 1.0, 2.0
A, B = b"a" * 16, b"b" * 16


def make():
    clock = FakeClock()
    live = Liveness(clock, 10.0, LOCK_DELAY)
    fence = ReaderFence(live, clock, READER_TTL, GRACE, 10.0, LOCK_DELAY)
    pool = PoolPages("p", 4)
    fence.renew(pool)
    return fence, live, pool, clock


@pytest.mark.parametrize("reader_ttl_s, grace_s", [(0.0, 1.0), (5.0, -1.0)])
def test_bounds_are_checked_when_it_is_made(reader_ttl_s, grace_s):
    with pytest.raises(ValueError):
        ReaderFence(Liveness(FakeClock(), 1.0, 1.0), FakeClock(), reader_ttl_s, grace_s, 10.0, 1.0)


def test_stale_owners_are_those_not_held_past_the_grace_and_the_fence_revokes_nothing_itself():
    fence, _, pool, clock = make()
    pool.open_owner(A, clock.now)
    pool.open_owner(B, clock.now - GRACE - 0.1)
    assert fence.keep_alive(pool, {A}) == [B]
    assert fence.keep_alive(pool, set()) == [B]  # A's Grant reply may still be on its way
    clock.now += GRACE + 0.1
    assert fence.keep_alive(pool, set()) == [A, B]
    assert list(pool.owners) == [A, B] and pool.reader_expiry == clock.now + READER_TTL  # decisions only


def test_a_revoked_owner_is_held_until_its_reader_acknowledges_having_seen_the_revocation():
    fence, live, pool, clock = make()
    fence.revoked(pool, A, "revoked/p/a", seq=3)
    assert pool.unacked == {A: ("revoked/p/a", 3)}
    live.prune(clock.now + 1e9)
    assert len(live) == 1  # held however long the reader takes
    clock.now += 100.0
    fence.acknowledge_absent(pool, set(), revocations_seen=2)  # built before it saw the revocation
    fence.acknowledge_absent(pool, {A}, revocations_seen=3)  # a step of A may still run
    assert A in pool.unacked
    fence.acknowledge_absent(pool, set(), revocations_seen=3)
    assert pool.unacked == {}
    assert live.may_land("revoked/p/a", clock.now + LOCK_DELAY - 0.01)
    assert not live.may_land("revoked/p/a", clock.now + LOCK_DELAY)


def test_a_fenced_pool_acknowledges_at_once_refuses_work_and_is_forgotten_once_drained():
    fence, live, pool, clock = make()
    expiry = pool.reader_expiry
    clock.now = expiry
    with pytest.raises(LeaseError) as e:
        fence.check(pool)
    assert e.value.reason == "POOL_FENCED"
    with pytest.raises(LeaseError) as e:
        fence.keep_alive(pool, set())
    assert e.value.reason == "POOL_EXPIRED"
    fence.revoked(pool, A, "revoked/p/a", seq=1)
    assert pool.unacked == {} and not live.may_land("revoked/p/a", expiry + LOCK_DELAY)
    assert fence.forgettable([pool]) == []  # a write may still land for lock_delay
    clock.now += LOCK_DELAY
    assert fence.forgettable([pool]) == ["p"]
    fence.check_not_forgotten("p")
    fence.forgotten("p")
    with pytest.raises(LeaseError) as e:
        fence.check_not_forgotten("p")
    assert e.value.reason == "POOL_FORGOTTEN"
