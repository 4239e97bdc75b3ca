"""Decode's request table (requests.py) against a tiny independent model, driven by a Hypothesis state machine:
every transition tried on every owner in any order, the legal ones checked to do what the model does and the
illegal ones to raise (or, for the lookups that may find nothing, to return None) and change nothing."""
import grpc
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pdserve.common.errors import PdError
from pdserve.decode.allocations import Allocation
from pdserve.decode.requests import RequestTable, State
from pdserve.decode.sequence import Sequence
from pdserve.engine.sampler import SamplingParams
from pdserve.engine.tags import expected_tags

OWNERS = [bytes([i]) * 16 for i in range(4)]
HOLDING = {"granting", "allocated", "joining", "running"}
ERR = PdError(grpc.StatusCode.UNAVAILABLE, "TEST", "ended by the test")


def _seq(owner: bytes) -> Sequence:
    return Sequence(owner, 1, [(0, 1)], expected_tags(owner, 1, [(0, 1)]), 4, SamplingParams(max_tokens=4),
                    frozenset(), [1])


class RequestMachine(RuleBasedStateMachine):
    """Model: each known owner's state, whether a joining one has its Sequence, its allocation's deadline, its
    cached pages, and the owners of the step in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.table = RequestTable()
        self.state: dict[bytes, str] = {}
        self.has_seq: set[bytes] = set()
        self.deadline: dict[bytes, float] = {}  # of each allocated owner
        self.allocs: dict[bytes, Allocation] = {}
        self.seqs: dict[bytes, Sequence] = {}
        self.readonly: dict[bytes, set[int]] = {}
        self.stepping: frozenset[bytes] = frozenset()

    def _illegal(self, fn, *args, reason: str = "ILLEGAL_TRANSITION") -> None:
        before = {o: self.table.state(o) for o in OWNERS}
        with pytest.raises(PdError) as e:
            fn(*args)
        assert e.value.reason == reason, e.value
        assert {o: self.table.state(o) for o in OWNERS} == before

    def _to(self, owner: bytes, state: str | None) -> None:
        if state is None:
            self.state.pop(owner, None)
            self.readonly.pop(owner, None)
        else:
            self.state[owner] = state
        if state != "allocated":
            self.deadline.pop(owner, None)
        if state not in ("joining", "running"):
            self.has_seq.discard(owner)

    @rule(owner=st.sampled_from(OWNERS))
    def begin_grant(self, owner):
        if owner in self.state:
            self._illegal(self.table.begin_grant, owner, reason="OWNER_HAS_LEASE")
            return
        self.table.begin_grant(owner)
        self._to(owner, "granting")

    @rule(owner=st.sampled_from(OWNERS))
    def grant_failed(self, owner):
        if self.state.get(owner) != "granting":
            self._illegal(self.table.grant_failed, owner)
            return
        self.table.grant_failed(owner)
        self._to(owner, None)

    @rule(owner=st.sampled_from(OWNERS))
    def grant_refused(self, owner):
        if self.state.get(owner) != "granting":
            self._illegal(self.table.grant_refused, owner)
            return
        self.table.grant_refused(owner)
        self._to(owner, "ended")

    @rule(owner=st.sampled_from(OWNERS), deadline=st.integers(0, 10))
    def granted(self, owner, deadline):
        alloc = Allocation(1, [(0, 1)], 4, 4, float(deadline))
        if self.state.get(owner) != "granting":
            self._illegal(self.table.granted, owner, alloc)
            return
        assert self.table.granted(owner, alloc) is alloc
        self._to(owner, "allocated")
        self.deadline[owner], self.allocs[owner] = float(deadline), alloc

    @rule(owner=st.sampled_from(OWNERS), same=st.booleans())
    def take(self, owner, same):
        alloc = self.allocs.get(owner) if same else Allocation(1, [], 1, 1, 0.0)
        got = self.table.take(owner, alloc)
        if self.state.get(owner) == "allocated" and same:
            assert got is alloc
            self._to(owner, "joining")
        else:
            assert got is None

    @rule(owner=st.sampled_from(OWNERS))
    def drop_allocation(self, owner):
        alloc = self.allocs.get(owner)
        got = self.table.drop_allocation(owner, alloc) if alloc is not None else None
        if self.state.get(owner) == "allocated":
            assert got is alloc
            self._to(owner, "ended")
        else:
            assert got is None

    @rule(owner=st.sampled_from(OWNERS))
    def end_allocation(self, owner):
        got = self.table.end_allocation(owner, ERR)
        if self.state.get(owner) == "allocated":
            assert got is self.allocs[owner] and got.ended is ERR
            self._to(owner, "ended")
        else:
            assert got is None

    @rule(now=st.integers(0, 11))
    def expire(self, now):
        due = {o for o, d in self.deadline.items() if d < now}
        assert {o for o, _ in self.table.expire(float(now))} == due
        for owner in due:
            self._to(owner, "ended")

    @rule()
    def end_allocations(self):
        assert {o for o, _ in self.table.end_allocations(ERR)} == set(self.deadline)
        for owner in list(self.deadline):
            self._to(owner, "ended")

    @rule(owner=st.sampled_from(OWNERS))
    def join(self, owner):
        seq = _seq(owner)
        if owner in self.state and (self.state[owner] != "joining" or owner in self.has_seq):
            self._illegal(self.table.join, seq)
            return
        self.table.join(seq)
        self._to(owner, "joining")
        self.has_seq.add(owner)
        self.seqs[owner] = seq

    @rule(owner=st.sampled_from(OWNERS))
    def leave(self, owner):
        self.table.leave(owner)
        if self.state.get(owner) == "joining":
            self._to(owner, "ended")

    @rule(owner=st.sampled_from(OWNERS))
    def start(self, owner):
        seq = self.seqs.get(owner) or _seq(owner)
        if self.state.get(owner) != "joining" or owner not in self.has_seq:
            self._illegal(self.table.start, seq)
            return
        self.table.start(seq)
        self._to(owner, "running")

    @rule(data=st.data(), any_owner=st.booleans())
    def finish(self, data, any_owner):
        # half the time one the step in flight names, when there is one: the loop must never end it meanwhile
        owner = data.draw(st.sampled_from(OWNERS if any_owner or not self.stepping else sorted(self.stepping)))
        if self.state.get(owner) != "running" or owner in self.stepping:
            self._illegal(self.table.finish, owner)
            return
        self.table.finish(owner)
        self._to(owner, "ended")

    @rule(owner=st.sampled_from(OWNERS))
    def forget(self, owner):
        if self.state.get(owner) not in (None, "ended"):
            self._illegal(self.table.forget, owner)
            return
        assert self.table.forget(owner) == frozenset(self.readonly.get(owner, ()))
        self._to(owner, None)

    @rule(owner=st.sampled_from(OWNERS), pages=st.sets(st.integers(0, 7), max_size=3))
    def share(self, owner, pages):
        if self.state.get(owner) not in ("granting", "joining", "running", "ended"):
            self._illegal(self.table.share, owner, pages)
            return
        self.table.share(owner, pages)
        self.readonly.setdefault(owner, set()).update(pages)

    @rule(data=st.data(), any_owners=st.booleans())
    def step_began(self, data, any_owners):
        # mostly some of the running requests (what the step loop names), sometimes any owners
        running = sorted(o for o, s in self.state.items() if s == "running")
        pool = OWNERS if any_owners or not running else running
        owners = data.draw(st.frozensets(st.sampled_from(pool), min_size=1))
        if self.stepping or any(self.state.get(o) != "running" for o in owners):
            with pytest.raises(PdError):
                self.table.step_began(owners)
            return
        self.table.step_began(owners)
        self.stepping = owners

    @rule()
    def step_ended(self):
        self.table.step_ended()
        self.stepping = frozenset()

    @invariant()
    def each_owner_is_in_exactly_the_models_state(self):
        for owner in OWNERS:
            s = self.table.state(owner)
            assert (s.value if s is not None else None) == self.state.get(owner), owner
        assert len(self.table) == len(self.state)
        assert sum(self.table.count(s) for s in State) == len(self.state)

    @invariant()
    def held_owners_are_those_in_a_holding_state_and_the_step_in_flight(self):
        held = {o for o, s in self.state.items() if s in HOLDING} | self.stepping
        assert self.table.held_owners() == held
        assert all(self.table.holds(o) == (o in held) for o in OWNERS)

    @invariant()
    def the_views_agree_with_the_states(self):
        assert set(self.table.running) == {o for o, s in self.state.items() if s == "running"}
        assert set(self.table.joining) == {o for o, s in self.state.items() if s == "joining" and o in self.has_seq}
        assert set(self.table.allocations) == set(self.deadline) == {o for o, s in self.state.items()
                                                                    if s == "allocated"}
        assert self.stepping <= set(self.table.running)  # a step only ever names running requests
        assert self.table.readonly_pages() == {o: frozenset(p) for o, p in self.readonly.items() if p}


TestRequestMachine = RequestMachine.TestCase
TestRequestMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_nothing_leaves_ended_but_its_release():
    """An ended request can only be forgotten: every other transition raises or finds nothing."""
    table, owner = RequestTable(), OWNERS[0]
    table.begin_grant(owner)
    table.grant_refused(owner)
    for fn, args in ((table.begin_grant, (owner,)), (table.grant_failed, (owner,)), (table.grant_refused, (owner,)),
                     (table.granted, (owner, Allocation(1, [], 1, 1, 9.0))), (table.join, (_seq(owner),)),
                     (table.start, (_seq(owner),)), (table.finish, (owner,)), (table.publish_started, (owner, None))):
        with pytest.raises(PdError):
            fn(*args)
    assert table.take(owner) is None and table.end_allocation(owner, ERR) is None
    table.leave(owner)
    assert table.state(owner) is State.ENDED and not table.holds(owner)
    table.forget(owner)
    assert table.state(owner) is None
