"""Decode's request table: the one owner of every request's state, from the Grant sent for it to its pages given
back. Each request is in exactly one state, and each transition below is one method with no await, so nothing can
run between a look at a request and its change; a transition the state does not allow raises
(ILLEGAL_TRANSITION), never passes silently.

    GRANTING --granted--> ALLOCATED --take--> JOINING --start--> RUNNING
       |                     |                   |                   |
       +--grant_failed (gone: nothing leased)    +--leave            +--finish
       +--grant_refused      +--end_allocation / expire / end_allocations
                  \\                 \\                  \\                  \\
                   +-----------------+------------------+------------------+--> ENDED --forget--> (gone)

GRANTING: its Grant is in flight. ALLOCATED: leased, waiting for its Decode call or its write-done notice (the
Allocation, with its deadline, lives in the composed `Allocations`, which hands each one out exactly once).
JOINING: Decode took it: verifying its prompt pages, sending its first token, never stepped. RUNNING: in the
batch, in the order it is next stepped. ENDED: its pages are being given back (its Publish awaited, its canary
filled, its Release sent); `forget`, at the end of that release, removes it.

The invariant, stated once: an owner's pages are held (listed in every KeepAlive, never released) exactly while it
is GRANTING, ALLOCATED, JOINING or RUNNING, or named by the step in flight; `held_owners` is that one query.

Besides its state a request carries the pages of it that are cached (shared with it, or published by it: read by
others, never canary-filled) and its Publish in flight, both kept until it is forgotten. Marking a request to end
(`mark`, `cancel`, `revoke`, `fail`) changes none of this: it flags its Sequence, which the step loop ends between
steps (or Decode, while it joins).
"""
from __future__ import annotations

import asyncio
import enum
import time
import types
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import grpc

from ..common.errors import PdError
from ..common.metrics import count_violation
from .allocations import Allocation, Allocations
from .sequence import Sequence


class State(enum.Enum):
    GRANTING = "granting"
    ALLOCATED = "allocated"
    JOINING = "joining"
    RUNNING = "running"
    ENDED = "ended"


HOLDING = frozenset({State.GRANTING, State.ALLOCATED, State.JOINING, State.RUNNING})


@dataclass(slots=True, eq=False)
class _Request:
    state: State
    seq: Sequence | None = None  # from JOINING on (None in the same tick between take and join)
    readonly: set[int] = field(default_factory=set)  # its pages that are cached: never canary-filled
    publishing: asyncio.Future | None = None  # its Publish in flight, awaited by its release


def illegal(owner: bytes, state: State | None, transition: str) -> PdError:
    return PdError(grpc.StatusCode.INTERNAL, "ILLEGAL_TRANSITION",
                   f"request {owner.hex()}: {transition} is not allowed from "
                   f"{state.value if state is not None else 'no state (unknown)'}")


class AllocatedView:
    """The table's ALLOCATED requests through the interface of `Allocations` (`in`, `len`, iteration, and each
    method one transition of the table)."""

    def __init__(self, table: "RequestTable", allocations: Allocations):
        self._table, self._allocations = table, allocations

    def add(self, owner: bytes, alloc: Allocation) -> Allocation:
        self._table.begin_grant(owner)
        return self._table.granted(owner, alloc)

    def take(self, owner: bytes, alloc: Allocation | None = None) -> Allocation | None:
        return self._table.take(owner, alloc)

    def end(self, owner: bytes, err: PdError) -> Allocation | None:
        return self._table.end_allocation(owner, err)

    def expire(self, now: float | None = None) -> list[tuple[bytes, Allocation]]:
        return self._table.expire(now)

    def end_all(self, err: PdError) -> list[tuple[bytes, Allocation]]:
        return self._table.end_allocations(err)

    def __contains__(self, owner: bytes) -> bool:
        return owner in self._allocations

    def __len__(self) -> int:
        return len(self._allocations)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._allocations)


class RequestTable:
    def __init__(self) -> None:
        self._requests: dict[bytes, _Request] = {}
        self._allocations = Allocations()  # the Allocation of each ALLOCATED owner
        self._joining: dict[bytes, Sequence] = {}  # JOINING owners whose Sequence is known
        self._running: dict[bytes, Sequence] = {}  # RUNNING owners, in the order they are next stepped
        self._stepping: frozenset[bytes] = frozenset()  # owners of the step in flight, until it returns
        self._wake = asyncio.Event()  # set when a request marked to end or starting may need the step loop
        self.allocations = AllocatedView(self, self._allocations)
        self.joining: Mapping[bytes, Sequence] = types.MappingProxyType(self._joining)
        self.running: Mapping[bytes, Sequence] = types.MappingProxyType(self._running)

    # -- queries --
    def state(self, owner: bytes) -> State | None:
        r = self._requests.get(owner)
        return r.state if r is not None else None

    def __len__(self) -> int:
        return len(self._requests)

    def count(self, state: State) -> int:
        return sum(1 for r in self._requests.values() if r.state is state)

    def owners(self, state: State) -> list[bytes]:
        return [o for o, r in self._requests.items() if r.state is state]

    @property
    def stepping(self) -> frozenset[bytes]:
        return self._stepping

    def holds(self, owner: bytes) -> bool:
        """Whether the owner's pages may still be read or written here: they are not to be released."""
        r = self._requests.get(owner)
        return (r is not None and r.state in HOLDING) or owner in self._stepping

    def held_owners(self) -> set[bytes]:
        """Every owner whose pages decode may still use or write, the step in flight included: the broker revokes
        the others after its grace, and frees a revoked owner's pages only once it is no longer listed here."""
        return {o for o, r in self._requests.items() if r.state in HOLDING} | self._stepping

    def sequences(self) -> list[Sequence]:
        """Every running and joining request's Sequence (running first, in stepping order)."""
        return [*self._running.values(), *self._joining.values()]

    def claims(self) -> list[tuple[bytes, list[tuple[int, int]], list[bool]]]:
        """What decode hands over to a new leader (watch.py): every RUNNING request not marked to end, with its
        leases and, per lease, whether it is a cached page it reads. Only these: a request not yet running may still
        have its prompt written under the old term."""
        out = []
        for owner, seq in self._running.items():
            if not (seq.cancelled or seq.done):
                readonly = self._requests[owner].readonly
                out.append((owner, list(seq.leases), [page in readonly for page, _ in seq.leases]))
        return out

    def readonly(self, owner: bytes) -> frozenset[int]:
        r = self._requests.get(owner)
        return frozenset(r.readonly) if r is not None else frozenset()

    def readonly_of_others(self, owner: bytes) -> set[int]:
        return set().union(*(r.readonly for o, r in self._requests.items() if o != owner))

    def readonly_pages(self) -> dict[bytes, frozenset[int]]:
        """owner -> its cached pages, for every owner with any."""
        return {o: frozenset(r.readonly) for o, r in self._requests.items() if r.readonly}

    def publishes(self) -> dict[bytes, asyncio.Future]:
        """owner -> its Publish, for every owner not yet forgotten that started one."""
        return {o: r.publishing for o, r in self._requests.items() if r.publishing is not None}

    def publishing(self, owner: bytes) -> asyncio.Future | None:
        r = self._requests.get(owner)
        return r.publishing if r is not None else None

    def _get(self, owner: bytes, transition: str, *allowed: State) -> _Request:
        r = self._requests.get(owner)
        if r is None or r.state not in allowed:
            raise illegal(owner, r.state if r is not None else None, transition)
        return r

    # -- transitions: one method each, no await --
    def begin_grant(self, owner: bytes) -> None:
        """(unknown) -> GRANTING: held from before the Grant is sent, so a KeepAlive racing the reply does not get
        it revoked. An owner known here in any state, ENDED included (its release still under way), is refused."""
        if (r := self._requests.get(owner)) is not None:
            raise PdError(grpc.StatusCode.ALREADY_EXISTS, "OWNER_HAS_LEASE",
                          f"request {owner.hex()} is already known to this decode ({r.state.value})")
        self._requests[owner] = _Request(State.GRANTING)

    def grant_failed(self, owner: bytes) -> None:
        """GRANTING -> (unknown): the Grant leased nothing."""
        self._get(owner, "grant_failed", State.GRANTING)
        del self._requests[owner]

    def grant_refused(self, owner: bytes) -> None:
        """GRANTING -> ENDED: leases came back that decode will not use (a broker fault, a shared page that fails
        its check, a caller gone); the caller releases them."""
        self._get(owner, "grant_refused", State.GRANTING).state = State.ENDED

    def granted(self, owner: bytes, alloc: Allocation) -> Allocation:
        """GRANTING -> ALLOCATED."""
        r = self._get(owner, "granted", State.GRANTING)
        self._allocations.add(owner, alloc)
        r.state = State.ALLOCATED
        return alloc

    def take(self, owner: bytes, alloc: Allocation | None = None) -> Allocation | None:
        """ALLOCATED -> JOINING: the caller (Decode, or Run once its notice came) decodes it and gives its pages
        back. None (nothing changes) when it is not allocated, or (given `alloc`) holds another allocation."""
        r = self._requests.get(owner)
        if r is None or r.state is not State.ALLOCATED:
            return None
        found = self._allocations.take(owner, alloc)
        if found is not None:
            r.state = State.JOINING
        return found

    def drop_allocation(self, owner: bytes, alloc: Allocation) -> Allocation | None:
        """ALLOCATED -> ENDED, only while it still holds `alloc`: a Run that never reached decoding gives it back.
        None when someone else ended or took it."""
        r = self._requests.get(owner)
        if r is None or r.state is not State.ALLOCATED or self._allocations.take(owner, alloc) is None:
            return None
        r.state = State.ENDED
        return alloc

    def end_allocation(self, owner: bytes, err: PdError) -> Allocation | None:
        """ALLOCATED -> ENDED, recording why (Release, revocation): the caller releases what this returns (None:
        not allocated, nothing changes)."""
        r = self._requests.get(owner)
        if r is None or r.state is not State.ALLOCATED:
            return None
        alloc = self._allocations.end(owner, err)
        r.state = State.ENDED
        return alloc

    def expire(self, now: float | None = None) -> list[tuple[bytes, Allocation]]:
        """ALLOCATED -> ENDED for every allocation past its deadline, all in this one step; the caller releases
        them."""
        gone = self._allocations.expire(time.monotonic() if now is None else now)
        for owner, _ in gone:
            self._requests[owner].state = State.ENDED
        return gone

    def end_allocations(self, err: PdError) -> list[tuple[bytes, Allocation]]:
        """ALLOCATED -> ENDED for every allocation (drain, broker move), recording err; the caller releases them."""
        gone = self._allocations.end_all(err)
        for owner, _ in gone:
            self._requests[owner].state = State.ENDED
        return gone

    def join(self, seq: Sequence) -> None:
        """JOINING (taken, no Sequence yet) or unknown -> JOINING with its Sequence: from here the step loop's
        marks reach it."""
        r = self._requests.get(seq.owner)
        if r is None:
            r = self._requests[seq.owner] = _Request(State.JOINING)
        elif r.state is not State.JOINING or r.seq is not None:
            raise illegal(seq.owner, r.state, "join")
        r.seq = seq
        self._joining[seq.owner] = seq

    def leave(self, owner: bytes) -> None:
        """JOINING -> ENDED: it never ran; the caller gives the pages back. Nothing when it is not joining."""
        r = self._requests.get(owner)
        if r is None or r.state is not State.JOINING:
            return
        self._joining.pop(owner, None)
        r.state = State.ENDED

    def start(self, seq: Sequence) -> None:
        """JOINING -> RUNNING, at the back of the stepping order."""
        r = self._get(seq.owner, "start", State.JOINING)
        if r.seq is not seq:
            raise illegal(seq.owner, r.state, "start of another Sequence")
        del self._joining[seq.owner]
        r.state = State.RUNNING
        self._running[seq.owner] = seq
        self._wake.set()

    def finish(self, owner: bytes) -> None:
        """RUNNING -> ENDED, between steps only: a step in flight may still write its pages."""
        r = self._get(owner, "finish", State.RUNNING)
        if owner in self._stepping:
            raise illegal(owner, r.state, "finish during the step that writes its pages")
        del self._running[owner]
        r.state = State.ENDED

    def forget(self, owner: bytes) -> frozenset[int]:
        """ENDED (or unknown) -> gone, as its release hands its pages to the broker; returns its cached pages
        (never canary-filled). Raises for an owner still held: its pages must not be released."""
        r = self._requests.get(owner)
        if r is None:
            return frozenset()
        if r.state is not State.ENDED:
            raise illegal(owner, r.state, "forget")
        del self._requests[owner]
        return frozenset(r.readonly)

    def rotate(self, batch: list[Sequence]) -> None:
        """Moves the batch's sequences to the back of the stepping order."""
        for seq in batch:
            del self._running[seq.owner]
            self._running[seq.owner] = seq

    def step_began(self, owners: frozenset[bytes]) -> None:
        """The step in flight names these RUNNING owners until `step_ended`."""
        if self._stepping:
            raise PdError(grpc.StatusCode.INTERNAL, "ILLEGAL_TRANSITION",
                          f"a step began while {len(self._stepping)} owners of another were stepping")
        for owner in owners:
            self._get(owner, "step_began", State.RUNNING)
        self._stepping = owners

    def step_ended(self) -> None:
        self._stepping = frozenset()

    # -- what a request carries besides its state --
    def share(self, owner: bytes, pages) -> None:
        """Records pages of the owner's that are cached (shared with it, or its own once published)."""
        self._get(owner, "share", State.GRANTING, State.JOINING, State.RUNNING, State.ENDED).readonly.update(pages)

    def publish_started(self, owner: bytes, task: asyncio.Future) -> None:
        r = self._get(owner, "publish_started", State.JOINING)
        if r.publishing is not None:
            raise illegal(owner, r.state, "a second publish_started")
        r.publishing = task

    def published(self, owner: bytes, pages) -> bool:
        """Its Publish made these pages cached: read-only from now on. False (nothing recorded) when the owner is
        already forgotten: its release ended it before the answer came."""
        r = self._requests.get(owner)
        if r is None or r.publishing is None:
            return False
        r.readonly.update(pages)
        return True

    # -- marks: a joining or running request ends with err between steps --
    def wake(self) -> None:
        self._wake.set()

    async def woken(self, timeout: float | None = None) -> None:
        """Returns once something was marked or started (or after timeout); clears the wake first."""
        self._wake.clear()
        if timeout is None:
            await self._wake.wait()
            return
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _find(self, owner: bytes) -> Sequence | None:
        return self._running.get(owner) or self._joining.get(owner)

    def _mark(self, seq: Sequence, err: PdError | None) -> None:
        seq.cancelled = True
        seq.err = seq.err or err
        self._wake.set()

    def mark(self, seq: Sequence, err: PdError) -> None:
        """Ends a sequence with err between steps (growth's refusals and preemptions, drain)."""
        if not seq.done:
            self._mark(seq, err)

    def cancel(self, owner: bytes) -> None:
        """Marks a request cancelled; the loop drops it (and releases its pages) between steps."""
        if (seq := self._find(owner)) is not None:
            self._mark(seq, None)

    def revoke(self, owner: bytes, err: PdError) -> None:
        """The broker ended the request's leases: a lease violation, counted once per request."""
        if (seq := self._find(owner)) is not None and not seq.done:
            if seq.first_revocation():
                count_violation("decode", "REVOKED", owner)
            self._mark(seq, err)

    def fail(self, owner: bytes, err: PdError) -> None:
        """Ends a request with err between steps, counted as nothing more (err says what it is)."""
        if (seq := self._find(owner)) is not None:
            self.mark(seq, err)

    def fail_all(self, err: PdError) -> None:
        for seq in self.sequences():
            self._mark(seq, err)


__all__ = ["HOLDING", "RequestTable", "State"]
