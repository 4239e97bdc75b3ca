"""The lease table against a small independent model, driven by a Hypothesis state machine: grants,
writes, acknowledgements, releases, revocations and time passing in any order."""
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.broker.lease_table import LeaseError, LeaseTable, PageState

from .test_lease_table import FakeClock

OWNERS, WRITERS = [bytes([i]) * 16 for i in range(3)], ["w0", "w1"]
NUM_PAGES, LOCK_DELAY, TTL = 6, 1.0, 1.0


class LeaseMachine(RuleBasedStateMachine):
    """Model: who holds what, which (page, gen) is being written by whom, and each writer's expiry."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        # the reader never expires here (reader liveness has its own tests: test_reader_liveness.py); its
        # KeepAlive acknowledges revocations
        self.table = LeaseTable(LOCK_DELAY, TTL, self.clock, epoch=1, reader_ttl_s=float("inf"))
        self.table.register_pool("p", NUM_PAGES)
        self.held: dict[bytes, list[tuple[int, int]]] = {}
        self.writes: dict[int, tuple[str, int]] = {}  # page -> (writer, gen), LEASED or QUARANTINED
        self.expiry: dict[str, float] = {}
        self.max_gen = [0] * NUM_PAGES
        self.history: list[tuple[int, int]] = []  # every lease ever granted, for stale requests
        self.sealed: set[tuple[int, int]] = set()  # leases a write began on: never written again
        self.unacked: dict[bytes, int] = {}  # revoked owners whose reader has not acknowledged -> revocation seq

    def held_pages(self) -> set[int]:
        return {p for leases in self.held.values() for p, _ in leases}

    @rule(owner=st.sampled_from(OWNERS), n=st.integers(1, 3))
    def grant(self, owner, n):
        num_free = NUM_PAGES - len(self.held_pages() | self.writes.keys())
        try:
            leases = self.table.grant("p", owner, n, 1)
        except LeaseError as e:
            assert e.reason == ("OWNER_HAS_LEASE" if owner in self.held else "POOL_EXHAUSTED")
            assert owner in self.held or n > num_free
            return
        assert owner not in self.held and n <= num_free
        assert [p for p, _ in leases] == sorted(p for p, _ in leases) and len({g for _, g in leases}) == 1
        for page, gen in leases:
            assert page not in self.writes, f"page {page} granted while {self.writes[page]} may still write it"
            assert gen > self.max_gen[page]
        self.held[owner] = leases
        self.history += leases

    @precondition(lambda self: self.held)
    @rule(writer=st.sampled_from(WRITERS), stale=st.booleans(), data=st.data())
    def begin_write(self, writer, stale, data):
        owner = data.draw(st.sampled_from(sorted(self.held)))
        choices = st.sampled_from(self.history if stale else self.held[owner])
        leases = data.draw(st.lists(choices, min_size=1, max_size=3, unique_by=lambda lease: lease[0]))
        ok = all(lease in self.held[owner] and lease[0] not in self.writes and lease not in self.sealed
                 for lease in leases)
        try:
            self.table.begin_write("p", owner, 1, leases, writer, 1.0)
        except LeaseError:
            assert not ok
            return
        assert ok
        # the first write of a grant seals every page of that grant, named or not (its headroom is decode's)
        gens = {gen for _, gen in leases}
        self.sealed.update(lease for lease in self.held[owner] if lease[1] in gens)
        self.writes.update({page: (writer, gen) for page, gen in leases})
        if self.expiry.get(writer, self.clock.now) <= self.clock.now:
            self.expiry[writer] = self.clock.now + TTL

    @precondition(lambda self: self.history)
    @rule(writer=st.sampled_from(WRITERS), epoch=st.sampled_from([1, 1, 2]), success=st.booleans(),
          nothing_posted=st.booleans(), data=st.data())
    def end_write(self, writer, epoch, success, nothing_posted, data):
        # the right acks, and stale, duplicate or foreign ones that must change nothing
        right = [(p, g) for p, (w, g) in self.writes.items() if w == writer]
        leases = data.draw(st.lists(st.sampled_from(right * 3 + self.history), max_size=4))
        held, expected = self.held_pages(), 0
        # a failed write that posted anything may still land: its pages stay held for lock_delay from the ack
        draining = None if success or nothing_posted else f"failed/{writer}"
        if draining is not None and epoch == 1:
            self.expiry[draining] = max(self.expiry.get(draining, 0.0), self.clock.now)
        for page, gen in leases if epoch == 1 else []:
            if self.writes.get(page) == (writer, gen):
                if draining is not None:
                    self.writes[page] = (draining, gen)
                    continue
                del self.writes[page]
                expected += page not in held
        assert self.table.end_write("p", OWNERS[0], epoch, leases, writer, success, nothing_posted) == expected

    @rule(owner=st.sampled_from(OWNERS), revoke=st.booleans())
    def release(self, owner, revoke):
        leases = self.held.pop(owner, [])
        num_written = sum(1 for page, _ in leases if page in self.writes)
        if not revoke:
            assert self.table.release("p", owner, 1) == (len(leases) - num_written, num_written)
            return
        # a revoked holder may still be mid-step: every page goes through quarantine until its reader acknowledges
        # (a KeepAlive that no longer lists it), then for lock_delay
        assert self.table.revoke("p", owner, "TEST") == (0, len(leases))
        holder = f"revoked/p/{owner.hex()}"
        for page, gen in leases:
            if page not in self.writes:
                self.writes[page] = (holder, gen)
        if leases:
            self.expiry[holder] = float("inf")
            self.unacked[owner] = self.table.last_seq("p")

    @rule(data=st.data())
    def reader_keep_alive(self, data):
        # the reader lists what it holds and some revoked owners whose step may still run, having seen the
        # revocations up to some seq
        still = data.draw(st.lists(st.sampled_from(sorted(self.unacked) or [OWNERS[0]]), unique=True))
        seen = data.draw(st.integers(0, self.table.last_seq("p")))
        self.table.reader_keep_alive("p", [*self.held, *still], seen)
        for owner in [o for o, seq in self.unacked.items() if o not in still and o not in self.held and seq <= seen]:
            del self.unacked[owner]
            self.expiry[f"revoked/p/{owner.hex()}"] = self.clock.now

    @rule(writer=st.sampled_from(WRITERS), ttl=st.sampled_from([0.5, 1.0, 3.0]))
    def keep_alive(self, writer, ttl):
        self.table.keep_alive(writer, ttl)
        # never shortened: a short renewal must not end a live writer's lease mid-write
        self.expiry[writer] = max(self.expiry.get(writer, self.clock.now), self.clock.now + ttl)

    @rule(dt=st.sampled_from([0.25, 0.5, 1.0, 2.5]))
    def advance_clock(self, dt):
        self.clock.now += dt

    @rule()
    def sweep(self):
        dead = {p for p, (w, _) in self.writes.items() if self.clock.now >= self.expiry[w] + LOCK_DELAY}
        assert self.table.sweep() == len(dead - self.held_pages())
        self.writes = {p: w for p, w in self.writes.items() if p not in dead}

    @invariant()
    def pages_agree_with_model(self):
        state = self.table.pool_state("p")
        assert state["num_free"] + state["num_leased"] + state["num_quarantined"] == NUM_PAGES
        quarantined = self.writes.keys() - self.held_pages()
        assert (state["num_quarantined"], state["num_writing"]) == (len(quarantined), len(self.writes))
        owned = [p for owner in OWNERS for p, _ in self.table.leases_of("p", owner)]
        assert len(owned) == len(set(owned)) == state["num_leased"]  # a page is in at most one lease
        assert all(self.table.leases_of("p", owner) == self.held.get(owner, []) for owner in OWNERS)
        for page in range(NUM_PAGES):
            info = self.table.page_info("p", page)
            assert info.generation >= self.max_gen[page]
            self.max_gen[page] = info.generation
            assert info.active_writer == self.writes.get(page)
            assert (info.state is PageState.QUARANTINED) == (page in quarantined)


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
