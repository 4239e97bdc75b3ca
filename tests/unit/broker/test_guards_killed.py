"""Broker guards that no test used to fail without (issue 18, point 8: a mutation pass over the lease table).
Pages a decode held under an earlier broker epoch start quarantined and stay out of every grant until a writer of
that epoch must have stopped; a writer's ttl given with BeginWrite holds its pages that long; malformed requests
are refused with their reason and leave nothing behind; the table refuses bounds the fence depends on."""
import pytest

from pdserve.broker.lease_table import LeaseTable, PageState

from .test_lease_table import A, FakeClock, make, refused

LOCK_DELAY, TTL = 2.0, 10.0  # make()'s lock_delay and default writer ttl
WRITTEN = (8, (11,), 5, b"d" * 16)


def test_pages_held_under_an_earlier_epoch_are_granted_to_nobody_until_its_writers_must_have_stopped():
    """After a broker restart decode registers its pool again naming every page it held: a writer of the old
    epoch may still land bytes there, so none of them may go to a new owner before that writer's ttl plus
    lock_delay."""
    table, clock = make(num_pages=4)
    table.register_pool("q", 4, quarantined=[1, 2])
    assert [table.page_info("q", p).state for p in range(4)] == [PageState.FREE, PageState.QUARANTINED,
                                                                   PageState.QUARANTINED, PageState.FREE]
    assert table.pool_state("q")["num_free"] == 2 and table.pool_state("q")["num_quarantined"] == 2
    refused("RESOURCE_EXHAUSTED", "POOL_EXHAUSTED", table.grant, "q", A, 3, 7)
    assert table.grant("q", A, 2, 7) == [(0, 1), (3, 1)]
    table.release("q", A, 7)
    clock.now += TTL + LOCK_DELAY - 0.1
    table.sweep()
    assert table.pool_state("q")["num_quarantined"] == 2
    refused("RESOURCE_EXHAUSTED", "POOL_EXHAUSTED", table.grant, "q", A, 3, 7)
    clock.now += 0.2
    assert table.sweep() == 2
    assert table.grant("q", A, 4, 7) == [(0, 2), (1, 2), (2, 2), (3, 2)]


def test_a_writer_ttl_given_with_begin_write_holds_its_pages_for_that_ttl():
    """BeginWrite's ttl stands for the KeepAlive the writer would have sent: a writer that asked for more than the
    default ttl sends no KeepAlive before it, so its pages must not leave quarantine at the default."""
    table, clock = make()
    leases = table.grant("p", A, 1, 7)
    table.begin_write("p", A, 7, leases, "w", 1.0, writer_ttl_s=2 * TTL)
    table.release("p", A, 7)
    clock.now += TTL + LOCK_DELAY + 0.1
    table.sweep()
    assert table.page_info("p", 0).state is PageState.QUARANTINED
    clock.now += TTL
    table.sweep()
    assert table.page_info("p", 0).state is PageState.FREE


def test_malformed_leases_and_ids_are_refused_with_their_reason_and_leave_nothing_behind():
    table, _ = make()
    leases = table.grant("p", A, 2, 7)
    before = table.pool_state("p")
    for fn, args in ((table.validate, ()), (table.begin_write, ("w", 1.0))):
        refused("INVALID_ARGUMENT", "NO_LEASES", fn, "p", A, 7, [], *args)
        refused("INVALID_ARGUMENT", "DUPLICATE_PAGE", fn, "p", A, 7, [leases[0], leases[0]], *args)
        err = refused("INVALID_ARGUMENT", "PAGE_OUT_OF_RANGE", fn, "p", A, 7, [leases[0], (8, 1)], *args)
        assert "page 8" in err.message and "8 pages" in err.message
    refused("INVALID_ARGUMENT", "BAD_WRITER_ID", table.begin_write, "p", A, 7, leases, "", 1.0)
    assert table.pool_state("p") == before and table.page_info("p", 0).active_writer is None
    # a successful EndWrite that names no lease announces nothing: decode would read on a notice of no page
    table.end_write("p", A, 7, [], "w", True, written=WRITTEN)
    assert table.revocations_since("p", 0) == ([], False, 0)
    err = refused("INVALID_ARGUMENT", "PAGE_OUT_OF_RANGE", table.register_pool, "q", 4, [2, 4])
    assert "[0, 4)" in err.message and "2..4" in err.message
    assert "q" not in table.pool_ids()


@pytest.mark.parametrize("kw", [dict(lock_delay_s=-0.5), dict(default_writer_ttl_s=0.0),
                                dict(default_writer_ttl_s=61.0, max_ttl_s=60.0), dict(epoch=0), dict(epoch=2**64),
                                dict(reader_ttl_s=0.0), dict(reconcile_grace_s=-1.0)],
                         ids=["negative lock_delay", "zero writer ttl", "writer ttl over max_ttl", "epoch 0",
                              "epoch of 65 bits", "zero reader ttl", "negative grace"])
def test_the_table_refuses_bounds_its_fence_and_quarantine_depend_on(kw):
    """fence = reader_ttl + max_ttl + lock_delay is what a moving decode waits out: a writer ttl above max_ttl, or a
    negative lock_delay, would let a write land after it."""
    with pytest.raises(ValueError) as e:
        LeaseTable(clock=FakeClock(), **kw)
    assert any(f"{v}" in str(e.value) for v in kw.values()), str(e.value)
