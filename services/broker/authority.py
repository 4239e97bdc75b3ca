"""Whether this broker process may authorise now, and under which term (docs/design.md §3, "Leader failover").

A broker run alone is its own authority, under term 0. A replica run with an election authorises only while it
leads, within the authority bound of `election.py`, and each authority (with its lease table) serves **one term**:
the table built in a term may name pages another leader has granted since, so once the term ends nothing in it is
answered from again. `main.py` then gives the servicer a fresh table and a fresh authority, which follow until the
replica wins a term of its own.

Every call is checked here, synchronously, just before the table acts on it; a caller's `term_seen` newer than
the term this replica holds means another leader already answered that caller while this one still believed it
led, which the authority bound exists to prevent: refused, and counted as an overlap (an alert that must never
fire)."""
from __future__ import annotations

from .election import Election, NotLeaderError


class TermOverlapError(NotLeaderError):
    """A caller has seen a newer term than the one this replica still holds by its own clock."""


class SoleAuthority:
    """A broker without election: always authorised, term 0."""
    term = 0
    elected = False

    def check(self, term_seen: int = 0) -> int:
        return 0


class ElectedAuthority:
    def __init__(self, election: Election) -> None:
        self.election = election
        self.term = 0  # the one term this process leads, from begin() on
        self.elected = True

    def begin(self, term: int) -> None:
        """The replica won `term` and took over (the lease identity is loaded): it answers from now on."""
        if self.term:
            raise RuntimeError(f"this replica led term {self.term} already; it cannot begin term {term}")
        self.term = term

    def check(self, term_seen: int = 0) -> int:
        """The term under which this replica may authorise now; NotLeaderError (with the numbers) otherwise."""
        term = self.election.check()
        if term != self.term:
            if self.term == 0:
                raise NotLeaderError(f"NOT_LEADER: this replica won term {term} and is still taking over")
            raise NotLeaderError(f"NOT_LEADER: this table served term {self.term}, which ended; the replica won term "
                                 f"{term} since, but answers nothing from the table of an earlier term")
        if term_seen > term:
            raise TermOverlapError(f"NOT_LEADER: the caller has seen term {term_seen}, newer than this replica's "
                                   f"term {term}, which it still held by its own clock: refused")
        return term

    def lost(self) -> bool:
        """True once the term this authority served is over (it never serves another). A lapse of its authority
        is not the end: while the replica still holds the key of that term nobody else can have led, and answers
        resume from the same table once etcd renews the lease again."""
        return self.term != 0 and self.election.held_term != self.term
