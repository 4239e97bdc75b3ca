"""The holders' liveness records on their own: a renewal never shortens one, a record is kept until expiry +
lock_delay and no longer, and only `end` moves one earlier."""
from pdserve.broker.liveness import Liveness

from .test_lease_table import FakeClock

TTL, LOCK_DELAY = 10.0, 2.0


def make() -> tuple[Liveness, FakeClock]:
    clock = FakeClock()
    return Liveness(clock, TTL, LOCK_DELAY), clock


def test_a_renewal_never_shortens_a_record():
    live, clock = make()
    live.renew("w", clock.now + 5.0)
    live.renew("w", clock.now + 1.0)  # a small ttl, e.g. a batched KeepAlive
    assert live.may_land("w", clock.now + 5.0 + LOCK_DELAY - 0.01)
    assert not live.may_land("w", clock.now + 5.0 + LOCK_DELAY)
    live.renew("w", clock.now + 7.0)
    assert live.may_land("w", clock.now + 7.0 + LOCK_DELAY - 0.01)


def test_start_replaces_only_an_expired_record():
    live, clock = make()
    live.renew("w", clock.now + 30.0)
    live.start("w", clock.now)  # a live record of 30 s is not cut to the default 10
    assert live.may_land("w", clock.now + 30.0 + LOCK_DELAY - 0.01)
    live.end("x", clock.now - 1.0)
    live.start("x", clock.now)  # an expired record counts as none: a beginning write gets a full ttl
    assert live.may_land("x", clock.now + TTL + LOCK_DELAY - 0.01)
    assert not live.may_land("x", clock.now + TTL + LOCK_DELAY)


def test_end_sets_the_record_even_earlier_and_defaults_to_now():
    live, clock = make()
    live.hold("revoked/p/o")
    assert live.may_land("revoked/p/o", clock.now + 1e9)
    live.end("revoked/p/o")  # acknowledged: lock_delay from now
    assert live.may_land("revoked/p/o", clock.now + LOCK_DELAY - 0.01)
    assert not live.may_land("revoked/p/o", clock.now + LOCK_DELAY)
    live.end("revoked/p/o", clock.now - LOCK_DELAY)  # fenced earlier: already past
    assert not live.may_land("revoked/p/o", clock.now)


def test_a_holder_without_a_record_gets_one_default_ttl_rather_than_being_presumed_dead():
    live, clock = make()
    assert len(live) == 0
    assert live.may_land("ghost", clock.now)
    assert len(live) == 1  # recorded: the next sweep counts from the same expiry
    assert live.may_land("ghost", clock.now + TTL + LOCK_DELAY - 0.01)
    assert not live.may_land("ghost", clock.now + TTL + LOCK_DELAY)


def test_prune_keeps_a_holder_until_expiry_plus_lock_delay_and_no_longer():
    live, clock = make()
    live.renew("a", clock.now + 1.0)
    live.renew("b", clock.now + 5.0)
    live.hold("held")
    live.prune(clock.now + 1.0 + LOCK_DELAY - 0.01)
    assert len(live) == 3
    live.prune(clock.now + 1.0 + LOCK_DELAY)
    assert len(live) == 2 and live.may_land("b", clock.now + 5.0)
    live.prune(clock.now + 5.0 + LOCK_DELAY)
    assert len(live) == 1  # held until acknowledged: never pruned
