"""services/broker/authority.py with a scripted election: a replica answers under one term in its life, from the end
of its take-over on, refuses once that term is over (even when it wins another), and refuses a caller that has
seen a newer term."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.broker.authority import ElectedAuthority, SoleAuthority, TermOverlapError
from pdserve.broker.election import NotLeaderError


class Scripted:
    """The part of Election the authority reads: check() gives `term` while `leads`."""

    def __init__(self) -> None:
        self.term, self.leads, self.holds = 0, False, True

    def check(self) -> int:
        if not self.leads:
            raise NotLeaderError("NOT_LEADER: scripted: not leading")
        return self.term

    def authorised(self) -> bool:
        return self.leads

    @property
    def held_term(self):
        return self.term if self.holds else None

    def state(self):
        return SimpleNamespace(term=self.term)


def test_a_sole_broker_always_answers_under_term_0():
    a = SoleAuthority()
    assert a.check() == 0 and a.check(term_seen=0) == 0 and a.term == 0 and not a.elected


def test_one_term_in_a_life():
    e = Scripted()
    a = ElectedAuthority(e)
    with pytest.raises(NotLeaderError, match="not leading"):
        a.check()
    assert a.term == 0 and not a.lost()  # a follower has lost nothing
    e.term, e.leads = 12, True
    with pytest.raises(NotLeaderError, match="won term 12 and is still taking over"):
        a.check()
    a.begin(12)
    assert a.check() == 12 and a.term == 12 and not a.lost()
    with pytest.raises(RuntimeError, match="led term 12 already"):
        a.begin(13)
    e.leads = False  # a lapse: refused, not over
    assert not a.lost()
    with pytest.raises(NotLeaderError):
        a.check()
    e.leads = True  # etcd renewed the same term's lease again: the same table answers
    assert a.check() == 12
    e.holds = False  # the term is over
    assert a.lost()
    e.term, e.leads, e.holds = 40, True, True  # won again before the process stopped: its table is of term 12
    with pytest.raises(NotLeaderError, match="served term 12, which ended; the replica won term 40"):
        a.check()
    assert a.lost() and a.term == 12


def test_a_caller_that_saw_a_newer_term_is_refused_as_an_overlap():
    e = Scripted()
    e.term, e.leads = 12, True
    a = ElectedAuthority(e)
    a.begin(12)
    assert a.check(term_seen=12) == 12 and a.check(term_seen=3) == 12
    with pytest.raises(TermOverlapError, match="seen term 13, newer than this replica's term 12"):
        a.check(term_seen=13)
