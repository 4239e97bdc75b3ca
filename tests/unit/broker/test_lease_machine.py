"""The lease table against a small independent model, driven by a Hypothesis state machine: grants (with prefix
chains that share cached pages), writes, acknowledgements, publishes, unpublishes, releases, revocations and time
passing in any order."""
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdserve.broker.lease_table import LeaseError, LeaseTable, PageState

from .test_lease_table import FakeClock

OWNERS, WRITERS = [bytes([i]) * 16 for i in range(3)], ["w0", "w1"]
NUM_PAGES, LOCK_DELAY, TTL = 6, 1.0, 1.0
CHAINS, TAGS = [bytes([0xC0 + i]) * 16 for i in range(4)], [b"t" * 8, b"t" * 8, b"u" * 8]
UNPUBLISHED = "unpublished/p"
# mostly a prompt's chain from its first page (what decode sends), sometimes any keys in any order
CHAIN_LISTS = st.one_of(st.integers(0, 3).map(lambda k: CHAINS[:k]), st.lists(st.sampled_from(CHAINS), max_size=3))


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
        self.written: set[tuple[int, int]] = set()  # leases a successful EndWrite covered
        # cached pages: page -> its chain, scope tag, generation, readers, pins (holders of revoked readers) and
        # whether a Grant still finds it; the chain index; the unread indexed pages, least recently read first
        self.cached: dict[int, dict] = {}
        self.index: dict[bytes, int] = {}
        self.lru: list[int] = []

    def held_pages(self) -> set[int]:
        """Pages held exclusively (an owner's list also holds its shares of cached pages)."""
        return {p for leases in self.held.values() for p, _ in leases if p not in self.cached}

    def settle(self, page: int) -> None:
        c = self.cached[page]
        if c["readers"] or c["pins"]:
            return
        if c["indexed"]:
            self.lru.append(page)
            return
        del self.cached[page]  # unpublished and unread: through quarantine, lock_delay from now
        self.writes[page] = (UNPUBLISHED, c["gen"])
        self.expiry[UNPUBLISHED] = self.clock.now

    @rule(owner=st.sampled_from(OWNERS), n=st.integers(1, 3), chains=CHAIN_LISTS, tag=st.sampled_from(TAGS))
    def grant(self, owner, n, chains, tag):
        run = []
        for chain in chains[:n - 1]:
            page = self.index.get(chain)
            if page is None or page in run or self.cached[page]["tag"] != tag:
                break
            run.append(page)
        free = set(range(NUM_PAGES)) - self.held_pages() - self.writes.keys() - self.cached.keys()
        need = n - len(run)
        evictable = [p for p in self.lru if p not in run]
        victims = evictable[:max(0, need - len(free))]
        try:
            leases, num_shared, checksums = self.table.grant_with_prefix("p", owner, n, 1, chains, tag)
        except LeaseError as e:
            assert e.reason == ("OWNER_HAS_LEASE" if owner in self.held else "POOL_EXHAUSTED")
            assert owner in self.held or need > len(free) + len(evictable)
            return
        assert owner not in self.held and need <= len(free) + len(evictable)
        assert leases[:num_shared] == [(p, self.cached[p]["gen"]) for p in run] and num_shared == len(run)
        assert checksums == [self.cached[p]["checksum"] for p in run]
        fresh = leases[num_shared:]
        # the lowest free pages once the least recently read unread pages are evicted: never a page with a
        # reader or a pin, never one a writer may still write
        assert [p for p, _ in fresh] == sorted(free | set(victims))[:need] and len({g for _, g in fresh}) == 1
        for page, gen in fresh:
            assert page not in self.writes, f"page {page} granted while {self.writes[page]} may still write it"
            assert gen > self.max_gen[page]
        for page in victims:
            del self.index[self.cached.pop(page)["chain"]]
            self.lru.remove(page)
        for page in run:
            self.cached[page]["readers"].add(owner)
            if page in self.lru:
                self.lru.remove(page)
        self.held[owner] = leases
        self.history += fresh

    @initialize(num_pages=st.integers(0, 3), tag=st.sampled_from(TAGS), release=st.booleans())
    def cache_a_prompt(self, num_pages, tag, release):
        """Most runs start with a prefix cached (its publisher still reading it, or gone), so that later
        grants, evictions, revocations and unpublishes meet cached pages early and often."""
        if num_pages:
            self.grant(OWNERS[2], num_pages + 1, [], tag)
            self.write_and_publish(OWNERS[2], WRITERS[0], tag, num_pages)
            if release:
                self.release(OWNERS[2], False)

    @precondition(lambda self: self.held)
    @rule(writer=st.sampled_from(WRITERS), data=st.data(), tag=st.sampled_from(TAGS), num_published=st.integers(0, 3))
    def prefill_writes(self, writer, data, tag, num_published):
        """An honest prefill's whole write of an owner's fresh pages: BeginWrite, then a successful EndWrite; then
        decode publishes the first pages of the prompt."""
        self.write_and_publish(data.draw(st.sampled_from(sorted(self.held))), writer, tag, num_published)

    def write_and_publish(self, owner, writer, tag, num_published):
        leases = [lease for lease in self.held[owner] if lease[0] not in self.cached]
        if not leases or any(lease in self.sealed or lease[0] in self.writes for lease in leases):
            return
        self.table.begin_write("p", owner, 1, leases, writer, 1.0)
        self.sealed.update(leases)
        if self.expiry.get(writer, self.clock.now) <= self.clock.now:
            self.expiry[writer] = self.clock.now + TTL
        held = self.held_pages()
        assert self.table.end_write("p", owner, 1, leases, writer, True) == sum(p not in held for p, _ in leases)
        self.written.update(leases)
        shares = len(self.held[owner]) - len(leases)
        self.do_publish(owner, leases[:num_published], CHAINS[shares:shares + len(leases[:num_published])], tag)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), tag=st.sampled_from(TAGS), chains=CHAIN_LISTS)
    def publish(self, data, tag, chains):
        owner = data.draw(st.sampled_from(sorted(self.held)))
        leases = data.draw(st.lists(st.sampled_from(self.held[owner] * 3 + self.history), min_size=len(chains),
                                    max_size=len(chains)))
        self.do_publish(owner, leases, chains, tag)

    def do_publish(self, owner, leases, chains, tag):
        checksums = list(range(7, 7 + len(leases)))
        expected = []
        for (page, gen), chain, checksum in zip(leases, chains, checksums):
            # the owner's exclusive current lease, written by a successful write, no writer on it, a new chain
            ok = ((page, gen) in self.held[owner] and page not in self.cached and (page, gen) in self.written
                  and page not in self.writes and chain not in self.index)
            if ok:
                self.cached[page] = {"chain": chain, "tag": tag, "gen": gen, "checksum": checksum,
                                     "readers": {owner}, "pins": set(), "indexed": True}
                self.index[chain] = page
            expected.append(ok)
        assert self.table.publish("p", owner, 1, leases, chains, checksums, tag) == expected

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def unpublish(self, data):
        owner = data.draw(st.sampled_from(sorted(self.held)))
        leases = data.draw(st.lists(st.sampled_from(self.held[owner] + self.history), max_size=3))
        expected = 0
        for page, gen in leases:
            c = self.cached.get(page)
            if c is not None and owner in c["readers"] and c["gen"] == gen and c["indexed"]:
                c["indexed"] = False
                del self.index[c["chain"]]
                expected += 1
        assert self.table.unpublish("p", owner, 1, leases, "TEST") == expected

    @precondition(lambda self: self.held)
    @rule(writer=st.sampled_from(WRITERS), stale=st.booleans(), data=st.data())
    def begin_write(self, writer, stale, data):
        owner = data.draw(st.sampled_from(sorted(self.held)))
        choices = st.sampled_from(self.history if stale else self.held[owner])
        leases = data.draw(st.lists(choices, min_size=1, max_size=3, unique_by=lambda lease: lease[0]))
        ok = all(lease in self.held[owner] and lease[0] not in self.writes and lease not in self.sealed
                 and lease[0] not in self.cached for lease in leases)
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
                if success:
                    self.written.add((page, gen))
        assert self.table.end_write("p", OWNERS[0], epoch, leases, writer, success, nothing_posted) == expected

    @rule(owner=st.sampled_from(OWNERS), revoke=st.booleans())
    def release(self, owner, revoke):
        leases = self.held.pop(owner, [])
        shares = [page for page, _ in leases if page in self.cached]
        own = [(page, gen) for page, gen in leases if page not in self.cached]
        num_written = sum(1 for page, _ in own if page in self.writes)
        holder = f"revoked/p/{owner.hex()}"
        # a cached page is never written: only the owner's share ends (a revoked one's step may still read it,
        # so its holder pins the page against eviction)
        for page in shares:
            self.cached[page]["readers"].discard(owner)
            if revoke:
                self.cached[page]["pins"].add(holder)
            self.settle(page)
        if not revoke:
            assert self.table.release("p", owner, 1) == (len(own) - num_written, num_written)
            return
        # a revoked holder may still be mid-step: every page it may write goes through quarantine until its reader
        # acknowledges (a KeepAlive that no longer lists it), then for lock_delay
        assert self.table.revoke("p", owner, "TEST") == (0, len(own))
        for page, gen in own:
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
        for page in [p for p, c in self.cached.items() if c["pins"]]:
            self.cached[page]["pins"] = {h for h in self.cached[page]["pins"]
                                         if self.clock.now < self.expiry[h] + LOCK_DELAY}
            self.settle(page)
        dead = {p for p, (w, _) in self.writes.items() if self.clock.now >= self.expiry[w] + LOCK_DELAY}
        assert self.table.sweep() == len(dead - self.held_pages())
        self.writes = {p: w for p, w in self.writes.items() if p not in dead}

    @invariant()
    def pages_agree_with_model(self):
        state = self.table.pool_state("p")
        assert state["num_free"] + state["num_leased"] + state["num_quarantined"] + state["num_cached"] == NUM_PAGES
        quarantined = self.writes.keys() - self.held_pages()
        assert (state["num_quarantined"], state["num_writing"]) == (len(quarantined), len(self.writes))
        owned = [p for owner in OWNERS for p, _ in self.table.leases_of("p", owner) if p not in self.cached]
        assert len(owned) == len(set(owned)) == state["num_leased"]  # a page is in at most one exclusive lease
        assert state["num_cached"] == len(self.cached)
        assert state["num_shared_reads"] == sum(len(c["readers"]) for c in self.cached.values())
        assert all(self.table.leases_of("p", owner) == self.held.get(owner, []) for owner in OWNERS)
        for page in range(NUM_PAGES):
            info = self.table.page_info("p", page)
            assert info.generation >= self.max_gen[page]
            self.max_gen[page] = info.generation
            assert info.active_writer == self.writes.get(page)
            assert (info.state is PageState.QUARANTINED) == (page in quarantined)
            assert (info.state is PageState.CACHED) == (page in self.cached)

    @invariant()
    def cached_pages_agree_with_model(self):
        cache = self.table._pools["p"].cache  # the table's own index and LRU, read, never changed here
        for chain, page in cache.index.items():  # never FREE (or anything but CACHED) and indexed
            assert self.table.page_info("p", page).state is PageState.CACHED and self.index.get(chain) == page
        assert cache.index.keys() == self.index.keys() and list(cache.lru) == self.lru
        for page, c in self.cached.items():
            info = self.table.page_info("p", page)
            assert page not in self.writes and info.active_writer is None  # never written while cached
            # its readers are exactly the owners whose lease lists hold it
            listed = {o for o in OWNERS if page in [p for p, _ in self.table.leases_of("p", o)]}
            assert info.readers == c["readers"] == listed and info.pins == c["pins"]
            assert (info.generation, info.chain, info.scope_tag) == (c["gen"], c["chain"], c["tag"])
            assert (page in self.lru) == (c["indexed"] and not c["readers"] and not c["pins"])


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
