"""Leases tied to the reader's liveness: owners a live decode no longer holds are revoked after the grace,
all leases of a pool whose decode stopped renewing are revoked, and both go through quarantine."""
from pdserve.broker.lease_table import LeaseTable, PageState
from pdserve.broker.revocation_log import RevocationLog

from .test_lease_table import FakeClock

A, B, C = b"a" * 16, b"b" * 16, b"c" * 16
LOCK_DELAY, READER_TTL, GRACE = 2.0, 5.0, 3.0


def make(num_pages: int = 8) -> tuple[LeaseTable, FakeClock]:
    clock = FakeClock()
    table = LeaseTable(lock_delay_s=LOCK_DELAY, default_writer_ttl_s=10.0, clock=clock, epoch=7,
                       reader_ttl_s=READER_TTL, reconcile_grace_s=GRACE)
    table.register_pool("p", num_pages)
    return table, clock


def reasons(table: LeaseTable) -> list[tuple[bytes, str]]:
    return [(e.owner, e.reason) for e in table.revocations_since("p", 0)[0]]


def test_an_unheld_owner_is_revoked_only_after_the_grace_and_through_quarantine():
    table, clock = make()
    table.grant("p", A, 2, 7)  # its reply was lost: decode never lists it
    table.grant("p", B, 3, 7)  # held
    clock.now += GRACE - 0.5
    table.grant("p", C, 1, 7)  # its Grant was still in flight when decode built the KeepAlive
    assert table.reader_keep_alive("p", [B]) == []
    assert table.pool_state("p")["num_leased"] == 6 and reasons(table) == []
    clock.now += 1.0  # A: GRACE + 0.5 old; C: 1 s old
    assert table.reader_keep_alive("p", [B]) == [A]
    assert reasons(table) == [(A, "NOT_HELD")]
    # A's pages are quarantined, not free: decode may still be mid-step on them
    assert [table.page_info("p", p).state for p in (0, 1)] == [PageState.QUARANTINED] * 2
    assert table.leases_of("p", B) == [(2, 2), (3, 2), (4, 2)] and table.leases_of("p", C) == [(5, 3)]
    table.reader_keep_alive("p", [B, C], table.last_seq("p"))  # decode saw the revocation: no step of A runs
    clock.now += LOCK_DELAY - 0.1
    table.sweep()
    assert table.pool_state("p")["num_quarantined"] == 2
    clock.now += 0.2
    table.sweep()
    assert table.pool_state("p") == {"epoch": 7, "num_pages": 8, "num_free": 4, "num_leased": 4,
                                     "num_quarantined": 0, "num_writing": 0, "num_cached": 0, "num_shared_reads": 0,
                                     "num_evictable": 0, "num_parked": 0}


def test_a_released_and_regranted_owner_gets_a_fresh_grace():
    table, clock = make()
    table.grant("p", A, 1, 7)
    clock.now += GRACE + 1
    table.release("p", A, 7)
    table.grant("p", A, 1, 7)
    assert table.reader_keep_alive("p", []) == []  # the new grant is 0 s old
    clock.now += GRACE + 0.1
    assert table.reader_keep_alive("p", []) == [A]


def test_reader_expiry_revokes_every_lease_through_quarantine_and_the_pool_drains():
    table, clock = make()
    table.grant("p", A, 2, 7)
    table.grant("p", B, 3, 7)
    leases_b = table.leases_of("p", B)
    table.begin_write("p", B, 7, leases_b[:1], "w", 1.0)  # a writer mid-write keeps its own bound
    table.keep_alive("w", 50.0)
    clock.now += READER_TTL - 0.5
    table.reader_keep_alive("p", [A, B])  # renewed: alive until +READER_TTL from here
    clock.now += READER_TTL - 0.1
    table.sweep()
    assert table.pool_state("p")["num_leased"] == 5 and reasons(table) == []
    clock.now += 0.2
    table.sweep()
    assert sorted(reasons(table)) == [(A, "READER_EXPIRED"), (B, "READER_EXPIRED")]
    state = table.pool_state("p")
    assert (state["num_leased"], state["num_quarantined"], state["num_free"]) == (0, 5, 3)
    clock.now += LOCK_DELAY + 0.1
    table.sweep()
    assert table.pool_state("p")["num_quarantined"] == 1  # the page under the live writer waits for it
    table.end_write("p", B, 7, leases_b[:1], "w", True)
    clock.now += LOCK_DELAY + 0.1  # whatever end_write does with a page, it is free after lock_delay
    table.sweep()
    assert table.pool_state("p") == {"epoch": 7, "num_pages": 8, "num_free": 8, "num_leased": 0,
                                     "num_quarantined": 0, "num_writing": 0, "num_cached": 0, "num_shared_reads": 0,
                                     "num_evictable": 0, "num_parked": 0}


def test_registration_starts_the_reader_record():
    table, clock = make()
    table.grant("p", A, 1, 7)
    clock.now += READER_TTL + 0.1  # a decode that registered and then died
    table.sweep()
    assert reasons(table) == [(A, "READER_EXPIRED")]


def test_revocation_log_numbers_replays_and_flags_a_gap():
    log = RevocationLog(capacity=3)
    assert log.since(0) == ([], False)
    for owner in (A, B, C, A, B):
        log.append(owner, 7, "R")
    assert [e.seq for e in log.since(2)[0]] == [3, 4, 5] and log.since(2)[1] is False
    assert [e.seq for e in log.since(4)[0]] == [5]
    assert log.since(5) == ([], False)
    events, gap = log.since(1)  # seq 2 fell out of the log
    assert gap and [e.seq for e in events] == [3, 4, 5]
    assert log.since(9)[1]  # a cursor from elsewhere covers nothing known here


def test_a_revoked_owners_pages_wait_for_its_readers_acknowledgement_however_long_its_step_runs():
    """Issue 18, hole 2: decode's step may still write a revoked owner's pages (a stalled step thread while its
    event loop renews). The pages leave quarantine lock_delay after the first KeepAlive that no longer lists the
    owner and has seen its revocation, never before, however much time passes."""
    table, clock = make()
    table.grant("p", A, 2, 7)
    table.grant("p", B, 2, 7)
    table.revoke("p", A, "OPERATOR")
    seq = table.last_seq("p")
    for _ in range(12):  # 48 s of a stalled step: decode keeps renewing, listing A
        clock.now += 4.0
        table.reader_keep_alive("p", [A, B], seq)
        table.sweep()
        assert [table.page_info("p", p).state for p in (0, 1)] == [PageState.QUARANTINED] * 2
    assert table.pool_state("p")["num_free"] == 4
    table.reader_keep_alive("p", [B], seq)  # the step returned: A is no longer listed
    clock.now += LOCK_DELAY - 0.1
    table.sweep()
    assert table.pool_state("p")["num_quarantined"] == 2
    clock.now += 0.2
    table.sweep()
    assert table.pool_state("p")["num_free"] == 6 and table.leases_of("p", B) == [(2, 2), (3, 2)]


def test_a_keep_alive_built_before_decode_saw_the_revocation_is_no_acknowledgement():
    """One that omits the owner but had not seen its revocation may come from before decode knew the owner (its
    Grant still in flight): only a list built after the revocation was processed tells that no step runs."""
    table, clock = make()
    table.grant("p", A, 2, 7)
    table.revoke("p", A, "OPERATOR")
    seq = table.last_seq("p")
    table.reader_keep_alive("p", [], seq - 1)
    clock.now += LOCK_DELAY + 0.1
    table.sweep()
    assert table.pool_state("p")["num_quarantined"] == 2
    table.reader_keep_alive("p", [], seq)
    clock.now += LOCK_DELAY + 0.1
    table.sweep()
    assert table.pool_state("p")["num_free"] == 8


def test_reader_expiry_acknowledges_for_a_pool_that_is_fenced_for_good():
    table, clock = make()
    table.grant("p", A, 2, 7)
    table.revoke("p", A, "OPERATOR")
    clock.now += READER_TTL + 0.1  # decode stopped renewing: the pool is fenced, nothing is granted from it again
    table.sweep()
    clock.now += LOCK_DELAY
    table.sweep()
    assert table.pool_state("p")["num_quarantined"] == 0
