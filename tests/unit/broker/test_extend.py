"""Pages on demand at the broker (LeaseTable.extend): growth pages are leased to an owner that holds leases now, at
a fresh generation sealed against any writer, one result per item; Release, Revoke and reconciliation end them
with the owner's other pages."""
import pytest

from pdserve.broker.lease_table import LeaseError, LeaseTable, PageState

from .test_lease_table import FakeClock

A, B, C = b"a" * 16, b"b" * 16, b"c" * 16
EPOCH, LOCK_DELAY = 7, 2.0


def make(num_pages: int = 8) -> tuple[LeaseTable, FakeClock]:
    clock = FakeClock()
    table = LeaseTable(lock_delay_s=LOCK_DELAY, default_writer_ttl_s=10.0, clock=clock, epoch=EPOCH,
                       reader_ttl_s=5.0, reconcile_grace_s=3.0)
    table.register_pool("p", num_pages)
    return table, clock


def test_growth_joins_the_owners_leases_at_a_fresh_generation():
    table, _ = make()
    prompt = table.grant("p", A, 2, EPOCH)
    table.grant("p", B, 1, EPOCH)
    [grown] = table.extend("p", EPOCH, [(A, 3)])
    generations = {g for _, g in prompt} | {g for _, g in table.leases_of("p", B)}
    assert [p for p, _ in grown] == [3, 4, 5] and len({g for _, g in grown}) == 1
    assert grown[0][1] not in generations and grown[0][1] > max(generations)
    assert table.leases_of("p", A) == prompt + grown  # in the order the owner uses them
    assert table.pool_state("p")["num_free"] == 2
    assert table.release("p", A, EPOCH) == (5, 0)  # the release ends prompt and growth pages alike
    assert all(table.page_info("p", p).state is PageState.FREE for p, _ in prompt + grown)


def test_each_item_is_all_or_nothing_on_its_own():
    table, _ = make(num_pages=6)
    table.grant("p", A, 1, EPOCH)
    table.grant("p", B, 1, EPOCH)
    a, b, none = table.extend("p", EPOCH, [(A, 5), (B, 3), (C, 1)])
    assert isinstance(a, LeaseError) and a.reason == "POOL_EXHAUSTED" and "4 free pages" in a.message
    assert [p for p, _ in b] == [2, 3, 4]
    assert isinstance(none, LeaseError) and none.reason == "OWNER_NOT_LEASED"  # C never held a lease
    assert table.leases_of("p", A) == [(0, 1)] and table.pool_state("p")["num_free"] == 1


def test_an_owner_released_or_revoked_gets_no_growth():
    """An Extend racing decode's Release or the operator's Revoke: pages leased to an owner nobody holds any more
    would never be released by it, and a step that still ran would write them after the revocation."""
    table, _ = make()
    table.grant("p", A, 2, EPOCH)
    table.grant("p", B, 2, EPOCH)
    table.release("p", A, EPOCH)
    table.revoke("p", B, "OPERATOR")
    free = table.pool_state("p")["num_free"]
    results = table.extend("p", EPOCH, [(A, 1), (B, 1)])
    assert [r.reason for r in results] == ["OWNER_NOT_LEASED"] * 2
    assert "(released or revoked)" in results[0].message and "(revoked: OPERATOR)" in results[1].message
    assert table.pool_state("p")["num_free"] == free and table.leases_of("p", B) == []


def test_no_writer_may_ever_begin_on_a_growth_page():
    """Decode's steps alone write growth pages: a prefill (hostile, or replaying) that learnt or guessed the lease
    must not land bytes on one; the per-step tag check would only see a tag it rewrote."""
    table, _ = make()
    table.grant("p", A, 1, EPOCH)
    [grown] = table.extend("p", EPOCH, [(A, 2)])
    with pytest.raises(LeaseError) as e:
        table.begin_write("p", A, EPOCH, grown, "prefill/p0/w", 1.0)
    assert e.value.reason == "LEASE_ALREADY_WRITTEN"


def test_revoked_growth_pages_wait_for_decodes_acknowledgement():
    table, clock = make()
    table.grant("p", A, 1, EPOCH)
    [grown] = table.extend("p", EPOCH, [(A, 2)])
    table.reader_keep_alive("p", [A])
    table.revoke("p", A, "OPERATOR")
    for _ in range(5):  # 20 s: a step stalled that long still lists A in every KeepAlive
        clock.now += 4.0
        table.reader_keep_alive("p", [A], table.last_seq("p"))
        table.sweep()
    # a step of A may still be writing them: held until a KeepAlive that saw the revocation no longer lists A
    assert all(table.page_info("p", p).state is PageState.QUARANTINED for p, _ in grown)
    table.reader_keep_alive("p", [], table.last_seq("p"))
    clock.now += LOCK_DELAY + 0.1
    table.sweep()
    assert all(table.page_info("p", p).state is PageState.FREE for p, _ in grown)


def test_a_stale_epoch_or_a_fenced_pool_refuses_the_whole_call():
    table, clock = make()
    table.grant("p", A, 1, EPOCH)
    with pytest.raises(LeaseError) as e:
        table.extend("p", EPOCH + 1, [(A, 1)])
    assert e.value.reason == "EPOCH_MISMATCH"
    clock.now += 60  # the pool's decode stopped renewing: fenced
    with pytest.raises(LeaseError) as e:
        table.extend("p", EPOCH, [(A, 1)])
    assert e.value.reason == "POOL_FENCED"
    assert len(table.leases_of("p", A)) <= 1  # nothing grown


def test_the_first_begin_write_of_a_grant_seals_its_headroom_pages_too():
    """The pages past the prompt are decode's to write: a second BeginWrite naming one of them (a hostile or
    replayed Prefill, with tags carrying the owner's words at the page index decode expects) is refused, and one
    that came first seals the prompt pages too, so the real write fails closed rather than mixing two writers."""
    table, _ = make()
    prompt, *headroom = table.grant("p", A, 3, EPOCH)
    table.begin_write("p", A, EPOCH, [prompt], "prefill/p0/w1", 1.0)
    with pytest.raises(LeaseError) as e:
        table.begin_write("p", A, EPOCH, [headroom[0]], "prefill/p0/w2", 1.0)
    assert e.value.reason == "LEASE_ALREADY_WRITTEN"
    first, *rest = table.grant("p", B, 3, EPOCH)
    table.begin_write("p", B, EPOCH, rest[::-1], "prefill/p1/w1", 1.0)  # the headroom, named first
    with pytest.raises(LeaseError) as e:
        table.begin_write("p", B, EPOCH, [first], "prefill/p0/w3", 1.0)
    assert e.value.reason == "LEASE_ALREADY_WRITTEN"
