"""The broker's write-done notice (issue 12): the one event decode's Run path reads on instead of a Validate call,
so it must appear exactly when Validate would pass at the EndWrite instant, once, in order with revocations."""
from pdserve.broker.lease_table import LeaseError
from tests.unit.broker.test_lease_table import A, B, make, refused

WRITTEN = (32, (11, 22), 5, b"d" * 16)  # num_tokens, checksums, first_token, prompt digest


def notices(table):
    return [e for e in table.revocations_since("p", 0)[0] if e.written is not None]


def test_successful_end_write_of_current_leases_logs_one_notice_with_what_was_written():
    table, _ = make()
    leases = table.grant("p", A, 2, 7)
    table.begin_write("p", A, 7, leases, "w", 1.0)
    table.end_write("p", A, 7, leases, "w", True, written=WRITTEN)
    table.end_write("p", A, 7, leases, "w", True, written=WRITTEN)  # a re-sent ack: the writer is no longer active
    [event] = notices(table)
    assert (event.owner, event.epoch, event.written) == (A, 7, (tuple(leases), *WRITTEN))
    table.validate("p", A, 7, leases)  # what the notice stands for: Validate passes at this point


def test_no_notice_for_a_failed_write_a_foreign_writer_a_revoked_lease_or_an_old_epoch():
    table, _ = make()
    leases = table.grant("p", A, 2, 7)
    table.begin_write("p", A, 7, leases, "w", 1.0)
    table.end_write("p", A, 7, leases, "other", True, written=WRITTEN)  # not the active writer
    table.end_write("p", A, 8, leases, "w", True, written=WRITTEN)  # another epoch
    table.end_write("p", A, 7, leases, "w", False, written=WRITTEN)  # failure
    assert notices(table) == []
    b = table.grant("p", B, 1, 7)
    table.begin_write("p", B, 7, b, "wb", 1.0)
    table.revoke("p", B, "TEST")  # revoked while written: the ack must not announce it as readable
    table.end_write("p", B, 7, b, "wb", True, written=WRITTEN)
    assert notices(table) == []
    refused("FAILED_PRECONDITION", "LEASE_NOT_CURRENT", table.validate, "p", B, 7, b)  # Validate agrees


def test_a_notice_comes_after_earlier_revocations_and_before_later_ones():
    table, _ = make()
    b = table.grant("p", B, 1, 7)
    table.revoke("p", B, "FIRST")
    leases = table.grant("p", A, 1, 7)
    table.begin_write("p", A, 7, leases, "w", 1.0)
    table.end_write("p", A, 7, leases, "w", True, written=WRITTEN)
    table.revoke("p", A, "LATER")
    assert [(e.owner, e.reason, e.seq) for e in table.revocations_since("p", 0)[0]] == [
        (B, "FIRST", 1), (A, "WRITE_DONE", 2), (A, "LATER", 3)]
    assert b


def test_begin_write_with_a_ttl_starts_the_writer_liveness_and_batched_keep_alive_renews_several():
    table, clock = make()
    leases = table.grant("p", A, 1, 7)
    table.begin_write("p", A, 7, leases, "w", 1.0, writer_ttl_s=3.0)
    table.release("p", A, 7)  # quarantined under the live writer
    clock.now += 3.0 + 2.0 - 0.1  # ttl + lock_delay not yet over
    table.sweep()
    assert table.pool_state("p")["num_quarantined"] == 1
    assert table.keep_alive_many(["w", "x"], 5.0) == []  # renewed: the page stays held past the old bound
    clock.now += 0.2
    table.sweep()
    assert table.pool_state("p")["num_quarantined"] == 1
    clock.now += 5.0 + 2.0
    table.sweep()
    assert table.pool_state("p")["num_quarantined"] == 0
    try:
        table.keep_alive_many(["w"], 0.0)
    except LeaseError as e:
        assert e.reason == "BAD_KEEP_ALIVE"
    else:
        raise AssertionError("a zero ttl must be refused")
