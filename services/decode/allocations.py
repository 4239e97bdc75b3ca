"""Decode's allocations: leases granted to a request whose pages are not yet being decoded (its Decode or Run
has not taken them). One owner of the table: every way an allocation ends (taken by Decode or Run, revoked,
released, expired, drained, moved) goes through `take` or `end`, which pop it in one step with no await, so each
allocation is handed out exactly once and its leases are released by exactly one party: whoever popped it.

The old table was a dict three mixins mutated, and the expiry loop released a snapshot of it across awaits:
an allocation Decode took meanwhile was released while it decoded (issue 18, hole 1; formal/mutants/expiry_race).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import grpc

from ..common.errors import PdError


@dataclass(slots=True, eq=False)
class Allocation:
    epoch: int
    leases: list[tuple[int, int]]
    num_prompt_tokens: int
    max_tokens: int
    deadline: float
    pool_id: str = ""  # the pool incarnation it was granted in
    # why it ended before anyone took it (revoked, released, expired, drained, moved): what a Run waiting for its
    # notice reports, rather than guessing from its absence
    ended: PdError | None = None
    # prefix reuse (reuse.py): the first num_shared leases are cached pages, checked, read-only to this request
    num_shared: int = 0
    shared_checksums: list[int] = field(default_factory=list)
    shared_words: Any = None  # their ownership words as checked (torch [num_shared, 5]), for the per-step check
    plan: Any = None  # reuse.PrefixPlan of a request with a prefix scope


class Allocations:
    def __init__(self) -> None:
        self._table: dict[bytes, Allocation] = {}

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, owner: bytes) -> bool:
        return owner in self._table

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self._table))

    def add(self, owner: bytes, alloc: Allocation) -> Allocation:
        if owner in self._table:
            raise PdError(grpc.StatusCode.ALREADY_EXISTS, "OWNER_HAS_LEASE",
                          f"request {owner.hex()} already has an allocation on pool {alloc.pool_id}")
        self._table[owner] = alloc
        return alloc

    def take(self, owner: bytes, alloc: Allocation | None = None) -> Allocation | None:
        """Pops the owner's allocation (only if it is `alloc`, when given): the caller now decodes it and releases
        it. None when it has ended or was taken already."""
        found = self._table.get(owner)
        if found is None or (alloc is not None and found is not alloc):
            return None
        del self._table[owner]
        return found

    def end(self, owner: bytes, err: PdError) -> Allocation | None:
        """Pops the owner's allocation, recording why it ended; the caller releases what this returns."""
        alloc = self._table.pop(owner, None)
        if alloc is not None:
            alloc.ended = err
        return alloc

    def expire(self, now: float | None = None) -> list[tuple[bytes, Allocation]]:
        """Pops every allocation past its deadline, all in this one step; the caller releases them."""
        now = time.monotonic() if now is None else now
        gone = [(o, a) for o, a in self._table.items() if a.deadline < now]
        for owner, alloc in gone:
            del self._table[owner]
            alloc.ended = PdError(grpc.StatusCode.DEADLINE_EXCEEDED, "NO_WRITE",
                                  f"no write-done notice or Decode call for {owner.hex()} within the allocation "
                                  f"timeout (expired {now - alloc.deadline:.2f}s ago)")
        return gone

    def end_all(self, err: PdError) -> list[tuple[bytes, Allocation]]:
        """Pops every allocation (drain, broker move), recording err; the caller releases them."""
        gone = list(self._table.items())
        self._table.clear()
        for _, alloc in gone:
            alloc.ended = err
        return gone
