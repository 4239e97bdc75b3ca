"""A pool handed over at a failover (LeaseTable.take_identity, adopt_pool): the cluster's epoch and generations above
every earlier term's; claimed leases stay their owners' (sealed, valid, released as usual), cached claims stay
cached with their readers, every other page waits until the earlier term's writes drained; a claim that
contradicts itself, names another epoch or is not of an earlier term is refused whole."""
import pytest

from pdserve.broker.lease_table import LeaseTable, PageState
from tests.unit.broker.test_lease_table import FakeClock, refused

A, B, C = b"a" * 16, b"b" * 16, b"c" * 16
EPOCH, OLD_TERM, TERM = 7, 3, 9
LOCK_DELAY, MAX_TTL = 2.0, 10.0


def leader(term: int = TERM) -> tuple[LeaseTable, FakeClock]:
    clock = FakeClock()
    table = LeaseTable(lock_delay_s=LOCK_DELAY, default_writer_ttl_s=5.0, max_ttl_s=MAX_TTL, clock=clock,
                       reader_ttl_s=float("inf"))
    table.take_identity(EPOCH, term)
    return table, clock


def old_gen(n: int) -> int:
    return (OLD_TERM << 32) + n


def test_the_identity_is_the_clusters_and_generations_start_above_earlier_terms():
    table, _ = leader()
    assert table.epoch == EPOCH and table.term == TERM
    table.register_pool("p", 4)
    (page, generation), = table.grant("p", A, 1, EPOCH)
    assert generation == TERM << 32
    with pytest.raises(RuntimeError, match="before any pool"):
        table.take_identity(EPOCH, TERM + 1)
    with pytest.raises(ValueError):
        LeaseTable().take_identity(EPOCH, 2**31)


def adopt(table, claims, num_pages=8, term_seen=OLD_TERM, epoch=EPOCH, cursor=5):
    return table.adopt_pool("p", num_pages, None, epoch, term_seen, cursor, claims)


def test_claimed_leases_stay_and_the_rest_drains():
    table, clock = leader()
    own_a = [(0, old_gen(4)), (1, old_gen(4)), (5, old_gen(9))]  # a prompt page pair and a growth page
    shared = (2, old_gen(1))  # a cached page A and B read
    assert adopt(table, [(A, [shared, *own_a], [True, False, False, False]),
                         (B, [shared, (3, old_gen(6))], [True, False])]) == EPOCH
    pool = table._pools["p"]
    assert [pool.pages[p].state for p in range(8)] == [
        PageState.LEASED, PageState.LEASED, PageState.CACHED, PageState.LEASED, PageState.QUARANTINED,
        PageState.LEASED, PageState.QUARANTINED, PageState.QUARANTINED]
    assert pool.pages[2].readers == {A, B}
    # what decode re-checks after its new stream comes up holds, shares included
    table.validate("p", A, EPOCH, [shared, *own_a], recheck=True)
    table.validate("p", B, EPOCH, [shared, (3, old_gen(6))], recheck=True)
    # sealed: no BeginWrite rewrites a page decode already reads
    refused("FAILED_PRECONDITION", "LEASE_ALREADY_WRITTEN", table.begin_write, "p", A, EPOCH, own_a[:2], "w", 1.0)
    # nothing free: a grant waits for the drain
    refused("RESOURCE_EXHAUSTED", "POOL_EXHAUSTED", table.grant, "p", C, 1, EPOCH)
    # the revocation log continues after decode's cursor
    assert table.last_seq("p") == 5 and table.revocations_since("p", 5) == ([], False, 5)
    # unclaimed pages: free only max_ttl + lock_delay after the hand-over
    clock.now += MAX_TTL + LOCK_DELAY - 0.01
    table.sweep()
    assert pool.pages[4].state is PageState.QUARANTINED
    clock.now += 0.02
    table.sweep()
    assert {p for p in range(8) if pool.pages[p].state is PageState.FREE} == {4, 6, 7}
    (page, generation), = table.grant("p", C, 1, EPOCH)
    assert page == 4 and generation == TERM << 32
    # A ends as usual: its own pages are free at once, the page B still reads stays cached
    assert table.release("p", A, EPOCH)[0] == 3
    assert pool.pages[2].state is PageState.CACHED and pool.pages[2].readers == {B}


@pytest.mark.parametrize("claims,why", [
    ([(A, [(0, old_gen(1))], [False]), (B, [(0, old_gen(1))], [False])], "two owners' own page"),
    ([(A, [(0, old_gen(1))], [False]), (B, [(0, old_gen(1))], [True])], "own and cached"),
    ([(A, [(0, old_gen(1))], [True]), (B, [(0, old_gen(2))], [True])], "cached at two generations"),
    ([(A, [(0, old_gen(1)), (0, old_gen(1))], [False, False])], "a page twice"),
    ([(A, [(8, old_gen(1))], [False])], "out of the pool"),
    ([(A, [(0, TERM << 32)], [False])], "a generation of this term"),
    ([(A, [(0, 0)], [False])], "generation 0"),
    ([(A, [(0, old_gen(1))], [False]), (A, [(1, old_gen(1))], [False])], "an owner twice"),
    ([(A, [(0, old_gen(1))], [False, True])], "flags and leases disagree")])
def test_a_claim_that_contradicts_itself_is_refused_whole(claims, why):
    table, _ = leader()
    refused("FAILED_PRECONDITION", "BAD_CLAIM", adopt, table, claims)
    assert "p" not in table.pool_ids()  # nothing adopted: decode registers a new incarnation instead


def test_only_a_pool_of_an_earlier_term_of_this_epoch_is_adopted():
    claims = [(A, [(0, old_gen(1))], [False])]
    table, _ = leader()
    refused("FAILED_PRECONDITION", "EPOCH_MISMATCH", adopt, table, claims, 8, OLD_TERM, EPOCH + 1)
    refused("FAILED_PRECONDITION", "NOT_AN_EARLIER_TERM", adopt, table, claims, 8, TERM)
    refused("FAILED_PRECONDITION", "NOT_AN_EARLIER_TERM", adopt, table, claims, 8, 0)
    refused("FAILED_PRECONDITION", "NOT_ELECTED", LeaseTable(epoch=EPOCH).adopt_pool, "p", 8, None, EPOCH,
            OLD_TERM, 0, claims)
    adopt(table, claims)
    refused("FAILED_PRECONDITION", "POOL_KNOWN", adopt, table, claims)


def test_a_lease_of_an_earlier_term_nobody_handed_over_is_refused_as_such_not_as_a_violation():
    table, _ = leader()
    adopt(table, [(A, [(0, old_gen(4))], [False])])
    # B's grant was the old leader's; B had not started decoding, so decode ended it and claimed nothing of it
    refused("UNAVAILABLE", "EARLIER_TERM_LEASE", table.begin_write, "p", B, EPOCH, [(1, old_gen(5))], "w", 1.0)
    refused("UNAVAILABLE", "EARLIER_TERM_LEASE", table.validate, "p", B, EPOCH, [(1, old_gen(5))])
    # a lease live for someone, or one of this term, is still a violation
    refused("FAILED_PRECONDITION", "LEASE_NOT_CURRENT", table.begin_write, "p", B, EPOCH, [(0, old_gen(4))], "w",
            1.0)
    refused("FAILED_PRECONDITION", "LEASE_NOT_CURRENT", table.begin_write, "p", B, EPOCH, [(1, TERM << 32)], "w",
            1.0)
