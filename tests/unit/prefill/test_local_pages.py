"""Prefill's LocalPages against a small independent model, driven by a Hypothesis state machine: reservations over
shared prefixes (with and without the destination's cached pages), forward passes writing a reservation's pages,
finishes (cached or not), holds after a failed write, releases before and after the landing bound, bytes of cached
pages changing, and misuse, in any order. The model holds, per page, what it is (free, cached, own to a live
reservation, held for a failed write) and what its bytes are; the real object is checked against it after every
step."""
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple,
                                 precondition, rule)

from pdserve.prefill.local_pages import LocalPages, Reservation, State

NUM_PAGES, LANDING_S = 12, 1.0
# two conversations: each prompt's chain is the first keys of one of them, so prompts share prefixes
CONVS = [[bytes([0xA0 + c, i]) * 8 for i in range(5)] for c in range(2)]


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


class LocalPagesMachine(RuleBasedStateMachine):
    live = Bundle("live")

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.data: dict[int, int] = {}  # page -> its bytes now, as their CRC-32C
        self.version = 0  # every forward pass writes new bytes
        self.local: LocalPages | None = None
        # the model
        self.free: set[int] = set(range(NUM_PAGES))
        self.cached: dict[int, tuple[bytes, int]] = {}  # indexed page -> (chain key, recorded CRC-32C)
        self.doomed: set[int] = set()  # out of the index for bad bytes, freed at their last unpin
        self.reservations: list[Reservation] = []  # every one handed out, in any state
        self.safe_at: dict[int, float] = {}  # id(held reservation) -> when its pages may be reused
        self.max_cached: int | None = None

    def checksums(self, pages):
        return [self.data.get(p, 0) for p in pages]

    def in_state(self, state: State) -> list[Reservation]:
        return [r for r in self.reservations if r.state is state]

    def pins(self, page: int) -> int:
        return sum(page in r.pages[:r.hit] for r in self.in_state(State.LIVE))

    def idle(self) -> set[int]:
        return {p for p in self.cached if not self.pins(p)}

    @initialize(max_cached=st.sampled_from([None, None, None, 3, 0]))
    def start(self, max_cached):
        self.max_cached = max_cached
        self.local = LocalPages(NUM_PAGES, self.checksums, max_cached, clock=self.clock)

    # mostly reuse as much as may be, with nothing at the destination: that is where hits and copies are
    @rule(target=live, conv=st.integers(0, 1), num_pages=st.integers(1, 4), partial=st.booleans(),
          reuse=st.sampled_from([4, 4, 4, 0, 1, 2]), cached_pages=st.sampled_from([0, 0, 0, 1, 2, 3]))
    def reserve(self, conv, num_pages, partial, reuse, cached_pages):
        # full pages under the scope: all of them, or all but a partial last one; the last page is always computed
        chains = CONVS[conv][:num_pages - 1 if partial else num_pages]
        reuse = min(reuse, num_pages - 1, len(chains))
        cached_pages = min(cached_pages, num_pages - 1)
        matched = []
        for key in chains[:reuse]:
            page = next((p for p, (k, _) in self.cached.items() if k == key), None)
            if page is None:
                break
            matched.append(page)

        def own(hit):
            return num_pages - hit + max(0, hit - cached_pages)
        before_free, before_idle = set(self.free), self.idle()
        fits = own(len(matched)) <= len(self.free) + len(before_idle - set(matched))
        checked = matched
        if fits:  # the re-check drops the first page whose bytes changed; the hit is the run before it
            bad = next((i for i, p in enumerate(matched) if self.data.get(p, 0) != self.cached[p][1]), None)
            if bad is not None:
                checked = matched[:bad]
                page = matched[bad]
                del self.cached[page]
                if self.pins(page):
                    self.doomed.add(page)
                else:
                    self.free.add(page)
            fits = own(len(checked)) <= len(self.free) + len(self.idle() - set(checked))
        res = self.local.reserve(num_pages, chains, cached_pages, reuse)
        if not fits:
            assert res is None
            return multiple()
        assert res is not None and res.state is State.LIVE
        assert res.hit == len(checked) and res.pages[:res.hit] == checked
        assert len(res.pages) == num_pages and len(res.copies) == max(0, res.hit - cached_pages)
        mine = res.own
        assert len(set(mine)) == len(mine) == own(res.hit)
        # own pages come from the free ones, or from cached pages nobody read (evicted, only as many as were short)
        evicted = set(mine) - self.free
        assert evicted <= before_idle - set(checked) and len(evicted) == max(0, len(mine) - len(self.free))
        for page in evicted:
            del self.cached[page]
        # never a page held for a failed write, never one another reservation owns
        assert not set(mine) & {p for r in self.in_state(State.HELD) + self.in_state(State.LIVE) for p in r.own}
        self.free -= set(mine)
        self.reservations.append(res)
        return res

    @rule(res=live)
    def forward_and_write(self, res):
        """The forward pass writes the pages after the hit, the write copies the hit into the copies: a cached page
        is never among what is written."""
        if res.state is not State.LIVE:
            return
        written = res.own
        assert not set(written) & (set(self.cached) | self.doomed), "a cached page would be written"
        for page in written:
            self.version += 1
            self.data[page] = 0x1000 + self.version

    def unpin(self, res: Reservation) -> None:
        """The model's side of a reservation's hit being unpinned (res already out of LIVE)."""
        for page in res.pages[:res.hit]:
            if page in self.doomed and not self.pins(page):
                self.doomed.discard(page)
                self.free.add(page)

    @rule(res=consumes(live), ok=st.sampled_from([True, True, False]), with_crcs=st.booleans())
    def finish(self, res, ok, with_crcs):
        if res.state is not State.LIVE:
            return
        full = len(res.chains)
        written = None
        if ok:  # the CRC-32C the write computed: the prompt's pages from where the write began, or none
            written = {i: self.data.get(res.pages[i], 0) for i in range(res.hit, full)} if with_crcs else {}
        indexed = {k for k, _ in self.cached.values()}
        fresh = [i for i in range(res.hit, full) if res.chains[i] not in indexed]
        num = self.local.finish(res, written)
        assert res.state is State.ENDED
        self.unpin(res)
        if written is None or self.max_cached == 0:
            assert num == 0
        elif self.max_cached is None:
            assert num == len(fresh)
        else:  # the limit evicts idle pages as it inserts: a key evicted meanwhile may be fresh again
            assert num <= full - res.hit
        now_cached = {p: (e.key, e.checksum) for p, e in self.local.cache._entries.items()}
        for page in set(self.cached) - set(now_cached):  # evicted for the page limit
            assert not self.pins(page)
            del self.cached[page]
            self.free.add(page)
        for page in res.own:
            if page in now_cached:
                key, crc = now_cached[page]
                i = res.pages.index(page)
                assert i in range(res.hit, full) and key == res.chains[i], "a page cached under another key"
                assert crc == self.data.get(page, 0), "a page cached with a CRC-32C not its bytes'"
                self.cached[page] = (key, crc)
            else:
                self.free.add(page)

    @rule(res=consumes(live))
    def hold_after_failed_write(self, res):
        if res.state is not State.LIVE:
            return
        assert self.local.hold_after_failed_write(res, LANDING_S) == self.clock.now + LANDING_S
        assert res.state is State.HELD
        self.safe_at[id(res)] = self.clock.now + LANDING_S
        self.unpin(res)

    @precondition(lambda self: any(r.state is State.HELD for r in self.reservations))
    @rule(data=st.data())
    def release_held(self, data):
        res = data.draw(st.sampled_from(self.in_state(State.HELD)))
        if self.clock.now < self.safe_at[id(res)]:
            with pytest.raises(RuntimeError, match="before its landing bound"):
                self.local.release_held(res)
            assert res.state is State.HELD
            return
        self.local.release_held(res)
        assert res.state is State.ENDED
        self.free |= set(res.own)

    @rule(dt=st.sampled_from([0.25, 0.5, 1.0]))
    def time_passes(self, dt):
        self.clock.now += dt

    @precondition(lambda self: self.cached)
    @rule(data=st.data())
    def bytes_change(self, data):
        """A bit flips in a cached page: the next reservation that would reuse it recomputes it instead."""
        page = data.draw(st.sampled_from(sorted(self.cached)))
        self.data[page] = self.data.get(page, 0) ^ 0x10

    @precondition(lambda self: any(r.state is not State.LIVE for r in self.reservations))
    @rule(data=st.data(), how=st.sampled_from(["finish", "hold", "release"]))
    def misuse_is_refused(self, data, how):
        """Ending a reservation twice, or the wrong way, changes nothing and says so."""
        res = data.draw(st.sampled_from([r for r in self.reservations if r.state is not State.LIVE]))
        if how == "release" and res.state is State.HELD:
            return
        state = res.state
        with pytest.raises(ValueError, match="cannot be"):
            if how == "finish":
                self.local.finish(res, {})
            elif how == "hold":
                self.local.hold_after_failed_write(res, LANDING_S)
            else:
                self.local.release_held(res)
        assert res.state is state

    @invariant()
    def every_page_is_exactly_one_thing(self):
        if self.local is None:
            return
        real_free = set(self.local.alloc._free)
        real_cached = set(self.local.cache._entries) | set(self.local.cache._doomed)
        live = [p for r in self.in_state(State.LIVE) for p in r.own]
        held = [p for r in self.in_state(State.HELD) for p in r.own]
        parts = [real_free, real_cached, set(live), set(held)]
        assert len(live) == len(set(live)), "a page in two live reservations"
        assert len(held) == len(set(held))
        assert sum(map(len, parts)) == NUM_PAGES and set().union(*parts) == set(range(NUM_PAGES))
        assert self.local.num_held == len(held)
        assert self.local.num_available == len(real_free) + len(self.idle())
        # the model agrees
        assert real_free == self.free
        assert {p: (e.key, e.checksum) for p, e in self.local.cache._entries.items()} == self.cached
        assert set(self.local.cache._doomed) == self.doomed

    @invariant()
    def cached_pages_are_read_only_and_pinned_by_their_readers(self):
        if self.local is None:
            return
        cache = self.local.cache
        for res in self.in_state(State.LIVE):
            for page in res.pages[:res.hit]:
                assert page in cache._entries or page in cache._doomed
            assert not set(res.own) & (set(cache._entries) | set(cache._doomed))
        for page, entry in cache._entries.items():
            assert entry.pins == self.pins(page)
        for page, pins in cache._doomed.items():
            assert pins == self.pins(page) > 0


TestLocalPagesMachine = LocalPagesMachine.TestCase
TestLocalPagesMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_a_reservation_made_elsewhere_is_refused():
    local = LocalPages(4, lambda pages: [0] * len(pages))
    with pytest.raises(ValueError, match="not this pool's"):
        local.finish(Reservation([0, 1]))
    assert local.alloc.num_free == 4
