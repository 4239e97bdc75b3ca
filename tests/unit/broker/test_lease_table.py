"""Lease table rules one by one (the Hypothesis state machine is in test_lease_machine.py)."""
import pytest

from pdserve.broker.lease_table import LeaseError, LeaseTable, PageState

A, B = b"a" * 16, b"b" * 16


class FakeClock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def make(num_pages: int = 8) -> tuple[LeaseTable, FakeClock]:
    clock = FakeClock()
    # no reader renews here: reader liveness has its own tests (test_reader_liveness.py)
    table = LeaseTable(lock_delay_s=2.0, default_writer_ttl_s=10.0, clock=clock, epoch=7, reader_ttl_s=float("inf"))
    table.register_pool("p", num_pages)
    return table, clock


def refused(kind: str, reason: str, fn, *args) -> LeaseError:
    with pytest.raises(LeaseError) as info:
        fn(*args)
    assert (info.value.kind, info.value.reason) == (kind, reason), info.value.message
    return info.value


def test_register_pool_is_idempotent_per_size_and_epochs_are_random_nonzero():
    table, _ = make()
    assert table.register_pool("p", 8) == 7
    refused("ALREADY_EXISTS", "POOL_SIZE_MISMATCH", table.register_pool, "p", 9)
    refused("INVALID_ARGUMENT", "BAD_POOL", table.register_pool, "q", 0)
    epochs = {LeaseTable().epoch for _ in range(4)}
    assert len(epochs) == 4 and 0 not in epochs


def test_grant_takes_lowest_free_pages_with_a_new_shared_generation():
    table, _ = make()
    assert table.grant("p", A, 3, 7) == [(0, 1), (1, 1), (2, 1)]
    assert table.grant("p", B, 2, 7) == [(3, 2), (4, 2)]
    assert table.release("p", A, 7) == (3, 0)
    # the freed low pages come back first, in ascending order, at a generation never seen before
    assert table.grant("p", A, 4, 7) == [(0, 3), (1, 3), (2, 3), (5, 3)]
    assert table.leases_of("p", A) == [(0, 3), (1, 3), (2, 3), (5, 3)]


def test_grant_refusals_leave_state_unchanged():
    table, _ = make()
    table.grant("p", A, 6, 7)
    before = table.pool_state("p")
    err = refused("RESOURCE_EXHAUSTED", "POOL_EXHAUSTED", table.grant, "p", B, 3, 7)
    assert "2 free pages of 8; 3 requested" in err.message
    refused("FAILED_PRECONDITION", "EPOCH_MISMATCH", table.grant, "p", B, 1, 8)
    refused("NOT_FOUND", "UNKNOWN_POOL", table.grant, "q", B, 1, 7)
    refused("ALREADY_EXISTS", "OWNER_HAS_LEASE", table.grant, "p", A, 1, 7)
    refused("INVALID_ARGUMENT", "BAD_NUM_PAGES", table.grant, "p", B, 0, 7)
    refused("INVALID_ARGUMENT", "BAD_OWNER", table.grant, "p", b"short", 1, 7)
    assert table.pool_state("p") == before and table.leases_of("p", B) == []
    assert table.grant("p", B, 2, 7) == [(6, 2), (7, 2)]  # the refused grants burnt no generation


def test_begin_write_needs_current_leases_and_is_atomic():
    table, _ = make()
    leases = table.grant("p", A, 2, 7)
    refused("FAILED_PRECONDITION", "LEASE_NOT_CURRENT", table.begin_write, "p", A, 7, [(0, 1), (1, 9)], "w", 1.0)
    refused("FAILED_PRECONDITION", "LEASE_NOT_CURRENT", table.begin_write, "p", B, 7, leases, "w", 1.0)
    refused("FAILED_PRECONDITION", "EPOCH_MISMATCH", table.begin_write, "p", A, 8, leases, "w", 1.0)
    assert table.pool_state("p")["num_writing"] == 0  # page 0 was not marked by the refused call
    table.begin_write("p", A, 7, leases[:1], "w", 1.0)
    assert table.page_info("p", 0).active_writer == ("w", 1)
    refused("FAILED_PRECONDITION", "WRITER_ACTIVE", table.begin_write, "p", A, 7, leases, "w2", 1.0)
    assert table.page_info("p", 1).active_writer is None


def test_validate_refuses_while_writing_and_after_release():
    table, _ = make()
    leases = table.grant("p", A, 2, 7)
    table.begin_write("p", A, 7, leases, "w", 1.0)
    refused("FAILED_PRECONDITION", "WRITER_ACTIVE", table.validate, "p", A, 7, leases)
    assert table.end_write("p", A, 7, leases, "w", True) == 0
    table.validate("p", A, 7, leases)
    table.validate("p", A, 7, leases)  # reading twice is fine; writing twice is not
    refused("FAILED_PRECONDITION", "EPOCH_MISMATCH", table.validate, "p", A, 8, leases)
    table.release("p", A, 7)
    # refused; as OWNER_RELEASED, which the broker does not count as a violation (decode itself let go)
    refused("FAILED_PRECONDITION", "OWNER_RELEASED", table.validate, "p", A, 7, leases)


def test_release_quarantines_written_pages_until_their_end_write_and_revoke_records_an_event():
    table, _ = make(num_pages=3)
    leases = table.grant("p", A, 3, 7)
    table.begin_write("p", A, 7, leases[1:], "w", 1.0)
    assert table.release("p", A, 8) == (0, 0)  # wrong epoch: a no-op
    assert table.release("p", A, 7) == (1, 2)
    assert table.release("p", A, 7) == (0, 0)
    assert table.page_info("p", 2).state is PageState.QUARANTINED
    refused("RESOURCE_EXHAUSTED", "POOL_EXHAUSTED", table.grant, "p", B, 2, 7)
    assert table.end_write("p", A, 8, leases[1:], "w", False) == 0  # wrong epoch changes nothing
    assert table.end_write("p", A, 7, leases[1:], "other-writer", False) == 0
    assert table.pool_state("p")["num_quarantined"] == 2
    # nothing was posted: no byte can still land, so the ack frees at once
    assert table.end_write("p", A, 7, leases[1:], "w", False, nothing_posted=True) == 2
    assert table.end_write("p", A, 7, leases[1:], "w", False, nothing_posted=True) == 0  # duplicate ack
    assert table.grant("p", B, 3, 7) == [(0, 2), (1, 2), (2, 2)]
    refused("NOT_FOUND", "UNKNOWN_POOL", table.end_write, "q", A, 7, leases, "w", True)
    assert table.revoke("p", B, "DRAIN") == (0, 3)  # B may still be mid-step: quarantined, not freed
    assert table.revocations_since("p", 0) == ([(B, 7, "DRAIN", 1, None)], False, 1)
    assert table.revocations_since("p", 1) == ([], False, 1)
    refused("RESOURCE_EXHAUSTED", "POOL_EXHAUSTED", table.grant, "p", A, 1, 7)


def test_stale_ack_of_an_old_generation_never_frees_a_newer_one():
    table, _ = make(num_pages=1)
    old = table.grant("p", A, 1, 7)
    table.begin_write("p", A, 7, old, "w", 1.0)
    table.release("p", A, 7)
    assert table.end_write("p", A, 7, old, "w", True) == 1
    assert (new := table.grant("p", B, 1, 7)) == [(0, 2)]
    table.begin_write("p", B, 7, new, "w", 1.0)
    table.release("p", B, 7)
    assert table.end_write("p", A, 7, old, "w", True) == 0  # the late duplicate of the gen-1 ack
    assert table.page_info("p", 0).state is PageState.QUARANTINED
    assert table.end_write("p", B, 7, new, "w", True) == 1


def test_sweep_frees_quarantine_only_after_liveness_expiry_plus_lock_delay():
    table, clock = make(num_pages=2)
    table.grant("p", A, 1, 7)
    table.grant("p", B, 1, 7)
    table.keep_alive("slow", 30.0)
    table.begin_write("p", A, 7, [(0, 1)], "slow", 1.0)
    table.begin_write("p", B, 7, [(1, 2)], "fast", 1.0)  # no record yet: expires at now + 10
    table.release("p", A, 7)
    table.release("p", B, 7)
    clock.now += 11.9
    assert table.sweep() == 0
    table.keep_alive("fast", 1.0)  # renewed: now expires at 112.9, freed at 114.9
    clock.now += 2.9
    assert table.sweep() == 0
    clock.now += 0.2
    assert table.sweep() == 1  # the later write's page goes first: deadlines are not ordered
    assert table.page_info("p", 1).state is PageState.FREE and table.page_info("p", 0).active_writer
    clock.now = 100.0 + 30.0 + 2.0
    assert table.sweep() == 1
    assert table.pool_state("p")["num_free"] == 2


def test_sweep_clears_a_dead_writer_of_a_live_lease_and_begin_write_revives_an_expired_one():
    table, clock = make()
    leases = table.grant("p", A, 1, 7)
    table.begin_write("p", A, 7, leases, "w", 1.0)
    clock.now += 12.0
    assert table.sweep() == 0
    table.validate("p", A, 7, leases)
    assert table.pool_state("p")["num_writing"] == 0
    refused("INVALID_ARGUMENT", "BAD_KEEP_ALIVE", table.keep_alive, "w2", 0)
    table.keep_alive("w2", 1.0)
    clock.now += 1.5  # expired, but within lock_delay: the record is still there
    other = table.grant("p", B, 1, 7)  # a lease generation is written once: a fresh lease for the second writer
    table.begin_write("p", B, 7, other, "w2", 1.0)  # must count as a fresh writer: alive until now + 10
    clock.now += 3.0
    table.sweep()
    refused("FAILED_PRECONDITION", "WRITER_ACTIVE", table.validate, "p", B, 7, other)


def test_failed_write_holds_its_pages_for_lock_delay_from_the_ack_even_after_release():
    """Mooncake's batch call returns failure while other tasks of the batch still run: the failed ack is no proof
    that nothing is in flight, so the pages are neither freed nor grantable until lock_delay after the ack."""
    table, clock = make(num_pages=2)  # lock_delay 2.0
    leases = table.grant("p", A, 2, 7)
    table.keep_alive("w", 30.0)  # the writer itself stays alive: only the failed ack's own bound may free
    table.begin_write("p", A, 7, leases, "w", 1.0)
    assert table.end_write("p", A, 7, leases, "w", False) == 0
    refused("FAILED_PRECONDITION", "WRITER_ACTIVE", table.validate, "p", A, 7, leases)
    assert table.release("p", A, 7) == (0, 2)
    clock.now += 1.9
    assert table.sweep() == 0
    refused("RESOURCE_EXHAUSTED", "POOL_EXHAUSTED", table.grant, "p", B, 1, 7)
    clock.now += 0.2
    assert table.sweep() == 2
    assert table.grant("p", B, 2, 7) == [(0, 2), (1, 2)]


def test_a_lease_generation_is_written_at_most_once():
    table, _ = make(num_pages=2)
    leases = table.grant("p", A, 2, 7)
    table.begin_write("p", A, 7, leases[:1], "w", 1.0)
    table.end_write("p", A, 7, leases[:1], "w", True)
    # a retry or replay of the same lease would rewrite pages decode may already have checked
    err = refused("FAILED_PRECONDITION", "LEASE_ALREADY_WRITTEN", table.begin_write, "p", A, 7, leases, "w2", 1.0)
    assert "page 0 generation 1" in err.message
    assert table.page_info("p", 1).active_writer is None  # refused whole: page 1 was not marked
    table.validate("p", A, 7, leases[1:])  # once decode validated, no writer may begin either
    refused("FAILED_PRECONDITION", "LEASE_ALREADY_WRITTEN", table.begin_write, "p", A, 7, leases[1:], "w", 1.0)


def test_writer_must_declare_a_landing_bound_within_lock_delay():
    table, _ = make()  # lock_delay 2.0
    leases = table.grant("p", A, 1, 7)
    err = refused("FAILED_PRECONDITION", "LANDING_BOUND_EXCEEDS_LOCK_DELAY", table.begin_write, "p", A, 7, leases,
                  "w", 2.5)
    assert "2.500s" in err.message and "2.000s" in err.message
    refused("FAILED_PRECONDITION", "LANDING_BOUND_EXCEEDS_LOCK_DELAY", table.begin_write, "p", A, 7, leases, "w", 0)
    table.begin_write("p", A, 7, leases, "w", 2.0)


def test_keep_alive_never_shortens_a_liveness_lease_and_is_capped():
    table, clock = make()
    leases = table.grant("p", A, 1, 7)
    table.keep_alive("w", 10.0)
    table.begin_write("p", A, 7, leases, "w", 1.0)
    table.release("p", A, 7)
    table.keep_alive("w", 0.001)  # a hostile or buggy short renewal must not end the write's lease
    clock.now += 5.0
    assert table.sweep() == 0
    refused("INVALID_ARGUMENT", "BAD_KEEP_ALIVE", table.keep_alive, "w", table.max_ttl_s + 1)


def test_pool_region_is_fixed_at_registration_and_handed_to_writers():
    table, _ = make()
    table.register_pool("q", 4, region=("decode:1", 0x1000, 0x2000))
    table.register_pool("q", 4, region=("decode:1", 0x1000, 0x2000))  # idempotent
    refused("ALREADY_EXISTS", "POOL_REGION_MISMATCH", table.register_pool, "q", 4, (), ("decode:1", 0x9000, 0x2000))
    leases = table.grant("q", A, 1, 7)
    assert table.begin_write("q", A, 7, leases, "w", 1.0) == ("decode:1", 0x1000, 0x2000)
