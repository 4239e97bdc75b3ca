"""services/common/terms.py: the newest broker term a process has seen only grows; an older answer is refused,
counted per rpc, and leaves the newest unchanged."""
from __future__ import annotations

import grpc
import pytest

from pdserve.common.errors import PdError
from pdserve.common.metrics import OLD_TERM_ANSWERS
from pdserve.common.terms import Terms


def count(rpc: str) -> float:
    return OLD_TERM_ANSWERS.labels("decode", rpc)._value.get()


def test_older_answers_are_refused_and_counted():
    t = Terms("decode")
    t.check(0, "KeepAlive")  # a broker without election
    t.check(7, "KeepAlive")
    t.check(7, "Grant")
    before = count("Grant")
    with pytest.raises(PdError) as e:
        t.check(5, "Grant")
    assert (e.value.code, e.value.reason) == (grpc.StatusCode.UNAVAILABLE, "OLD_TERM")
    assert "under term 5; this decode takes answers of term 7 or newer only" in e.value.message
    assert count("Grant") == before + 1 and t.newest == 7
    assert not t.fresh(0, "WatchRevocations") and t.fresh(9, "WatchRevocations") and t.newest == 9


def test_a_hand_over_takes_only_a_newer_terms_answers():
    t = Terms("decode")
    t.check(4, "KeepAlive")
    assert t.newer_only() == 4
    assert not t.fresh(4, "Extend")  # the term handed over: an Extend reply of it must not add pages now
    t.check(6, "ClaimPool")
    assert t.newest == 6 and not t.fresh(5, "Grant")
    t2 = Terms("decode")
    t2.check(4, "KeepAlive")
    t2.newer_only()
    t2.any_term()  # refused: decode registers anew, wherever the answers come from
    assert t2.fresh(4, "RegisterPool")
