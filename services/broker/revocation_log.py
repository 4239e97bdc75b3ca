"""A pool's revocations, numbered and kept in a bounded log, so a watcher that missed some (a send into a
dead stream, a reconnect) resumes from its cursor, and one that fell too far behind is told so."""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

DEFAULT_CAPACITY = 4096


class Revocation(NamedTuple):
    owner: bytes
    epoch: int
    reason: str
    seq: int = 0  # 1, 2, ... per pool within an epoch; 0 only before it is logged
    # a write-done notice, not a revocation: (leases, num_tokens, checksums, first_token, prompt digest) the writer
    # reported
    written: tuple | None = None


class RevocationLog:
    """The last `capacity` revocations of one pool (bounded by count, not age: a watcher that reconnects after
    a long outage still gets everything as long as few revocations happened, and memory stays bounded)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity <= 0:
            raise ValueError(f"revocation log capacity {capacity} must be > 0")
        self._events: deque[Revocation] = deque(maxlen=capacity)
        self.last_seq = 0

    def continue_after(self, seq: int) -> None:
        """A log taken over from an earlier leader: its next event is seq + 1, so a watcher whose cursor is seq
        resumes without a gap. Pre: nothing logged yet."""
        if self._events or self.last_seq:
            raise RuntimeError(f"a log continues an earlier one only while empty; it is at seq {self.last_seq}")
        self.last_seq = seq

    def append(self, owner: bytes, epoch: int, reason: str, written: tuple | None = None) -> Revocation:
        self.last_seq += 1
        event = Revocation(owner, epoch, reason, self.last_seq, written)
        self._events.append(event)
        return event

    def get(self, seq: int) -> Revocation | None:
        """The logged event numbered seq, or None when it is no longer (or not yet) logged."""
        oldest = self._events[0].seq if self._events else self.last_seq + 1
        return self._events[seq - oldest] if oldest <= seq <= self.last_seq else None

    def since(self, after_seq: int) -> tuple[list[Revocation], bool]:
        """Every logged revocation with seq > after_seq, and whether some of those are no longer logged (a gap).
        A cursor ahead of the log cannot come from this log: also a gap, since nothing it covers is known."""
        if after_seq > self.last_seq:
            return list(self._events), True
        oldest = self._events[0].seq if self._events else self.last_seq + 1
        gap = after_seq + 1 < oldest
        # seqs are contiguous in the deque: index arithmetic instead of a scan
        start = max(0, after_seq + 1 - oldest)
        return [self._events[i] for i in range(start, len(self._events))], gap
