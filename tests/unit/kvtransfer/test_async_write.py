"""The asynchronous write: posted tasks polled asleep, answered at the first failure or the deadline, and every
task kept (polled, so Mooncake frees its batch) until Mooncake says it ended. Against a scripted Mooncake."""
import threading
import time

import pytest

from pdserve.kvtransfer import engine as E
from pdserve.kvtransfer.engine import Inflight, Run, TransferEngine, TransferError


class ScriptedMooncake:
    """transfer_submit_write / transfer_check_status as Mooncake's binding has them: a batch id (0: refused),
    then 0 while running, 1 completed or -1 failed (both free the batch: a later look is a use after free)."""

    def __init__(self, outcomes, refuse_at=None):
        self.outcomes = list(outcomes)  # per posted task: (looks while running, final status)
        self.refuse_at = refuse_at
        self.tasks: dict[int, list] = {}
        self.freed: set[int] = set()
        self.log: list[tuple] = []  # ("post", id) / ("look", id, rc) / ("sleep", s), in order
        self.lock = threading.Lock()

    def transfer_submit_write(self, session, src, dst, nbytes):
        with self.lock:
            if self.refuse_at is not None and len(self.tasks) == self.refuse_at:
                return 0
            bid = 1000 + len(self.tasks)
            running, final = self.outcomes[len(self.tasks)]
            self.tasks[bid] = [running, final]
            self.log.append(("post", bid))
            return bid

    def transfer_check_status(self, bid):
        with self.lock:
            assert bid not in self.freed, f"batch {bid} looked at after Mooncake freed it"
            task = self.tasks[bid]
            if task[0] > 0:
                task[0] -= 1
                rc = 0
            else:
                rc = task[1]
                if rc in (1, -1):
                    self.freed.add(bid)
            self.log.append(("look", bid, rc))
            return rc


def make_engine(mc, timeout_s=5):
    eng = TransferEngine.__new__(TransferEngine)
    eng._engine, eng.timeout_s, eng.max_write_bytes = mc, timeout_s, 1 << 20
    eng._inflight = Inflight(mc.transfer_check_status)
    return eng


RUNS = [Run(0, 100, 64), Run(64, 300, 64), Run(128, 500, 32)]


@pytest.fixture
def sleeps(monkeypatch):
    """Records every sleep of a waiting writer in the scripted Mooncake's log (and sleeps for real, briefly)."""
    real = time.sleep

    def install(mc):
        def sleep(s):
            with mc.lock:
                mc.log.append(("sleep", s))
            real(min(s, 1e-3))
        monkeypatch.setattr(E.time, "sleep", sleep)
    return install


def wait_kept(eng, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while len(eng._inflight) and time.monotonic() < deadline:
        time.sleep(0.005)
    return len(eng._inflight)


def test_a_write_returns_once_every_task_completed_and_sleeps_between_looks(sleeps):
    mc = ScriptedMooncake([(3, 1), (5, 1), (0, 1)])
    sleeps(mc)
    assert make_engine(mc).write("peer", RUNS, "data") == 160
    assert mc.freed == {1000, 1001, 1002}  # every batch ended as completed, so Mooncake freed it
    kinds = [e[0] for e in mc.log]
    assert kinds[:3] == ["post"] * 3  # all of the call posted before any wait
    sweeps = "".join("L" if k == "look" else "S" for k in kinds[3:] if k != "post")
    # a look at each running task, then a sleep: never two sweeps without one (no busy poll)
    assert "SS" not in sweeps and sweeps[0] == "L" and sweeps[-1] == "L"
    assert sweeps.count("S") == 5  # the slowest task ran through five sweeps
    slept = [e[1] for e in mc.log if e[0] == "sleep"]
    assert slept[0] == pytest.approx(E.POLL_FIRST_S) and all(b > a for a, b in zip(slept, slept[1:]))
    assert max(slept) <= E.POLL_MAX_S


def test_a_failed_task_answers_at_once_and_its_running_siblings_are_kept_until_they_end(sleeps):
    mc = ScriptedMooncake([(0, -1), (40, 1), (60, -1)])
    sleeps(mc)
    eng = make_engine(mc)
    with pytest.raises(TransferError) as e:
        eng.write("peer", RUNS, "data")
    assert e.value.stage == "data" and e.value.posted
    assert "3 runs (160 bytes) to peer failed (task status -1); 2 of its tasks still running may land later" in str(e.value)
    assert {b for b, t in mc.tasks.items() if t[0] > 0} == {1001, 1002}  # answered while two were in flight
    assert wait_kept(eng) == 0
    assert mc.freed == {1000, 1001, 1002}  # kept and looked at until Mooncake freed each (never after)


def test_the_deadline_counts_from_the_post_and_leaves_the_tasks_kept(sleeps, monkeypatch):
    mc = ScriptedMooncake([(10**9, 1)])
    sleeps(mc)
    eng = make_engine(mc, timeout_s=5)
    clock = [1000.0]
    monkeypatch.setattr(E.time, "monotonic", lambda: clock[0])
    real_check = mc.transfer_check_status

    def check(bid):  # each look moves the clock on by a second: the deadline is 5 s + 1 ns per byte past the post
        clock[0] += 1.0
        return real_check(bid)
    mc.transfer_check_status = check
    eng._engine = mc
    with pytest.raises(TransferError, match=r"1 tasks still running past its deadline \(1.000s over\); they may "
                                            r"land later") as e:
        eng.write("peer", RUNS[:1], "tags")
    assert e.value.stage == "tags"
    assert sum(1 for x in mc.log if x[0] == "look") == 6  # at 1001..1005 within 1005 + 64 ns, 1006 past it
    assert len(eng._inflight) == 1 and not mc.freed  # kept: Mooncake has not said it ended


def test_a_refused_post_fails_the_call_and_keeps_what_was_posted_before_it(sleeps):
    mc = ScriptedMooncake([(20, 1), (0, 1), (0, 1)], refuse_at=2)
    sleeps(mc)
    eng = make_engine(mc)
    with pytest.raises(TransferError, match="Mooncake refused to post run 3 of 3 \\(32 bytes\\) of a write of 160 "
                                            "bytes to peer") as e:
        eng.write("peer", RUNS, "data")
    assert e.value.posted
    assert not any(x[0] == "look" for x in mc.log[:3])  # answered without waiting: the posted two are kept
    assert wait_kept(eng) == 0 and mc.freed == {1000, 1001}


def test_tags_are_posted_only_after_the_data_completed(sleeps):
    """What the worker relies on for data before tags: a write returns only once its tasks completed."""
    mc = ScriptedMooncake([(4, 1), (2, 1)])
    sleeps(mc)
    eng = make_engine(mc)
    eng.write("peer", [Run(0, 0, 64)], "data")
    done_at = next(i for i, x in enumerate(mc.log) if x[0] == "look" and x[2] == 1)
    eng.write("peer", [Run(64, 64, 64)], "tags")
    assert next(i for i, x in enumerate(mc.log) if x == ("post", 1001)) > done_at


def test_the_keeper_thread_exits_when_idle(monkeypatch):
    monkeypatch.setattr(E, "KEEP_LINGER_S", 0.05)
    mc = ScriptedMooncake([(3, 1)])
    keep = Inflight(mc.transfer_check_status)
    mc.transfer_submit_write("peer", 0, 0, 1)
    keep.adopt([1000])
    deadline = time.monotonic() + 5
    while keep._thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert keep._thread is None and len(keep) == 0 and mc.freed == {1000}


def test_a_status_that_cannot_be_read_fails_the_call_and_lets_only_that_task_go(sleeps):
    """The task whose status read raised is never looked at again (it may be freed); the others are kept until
    they end, and the keeper thread survives such a task too."""
    mc = ScriptedMooncake([(5, 1), (0, 1), (8, 1)])
    sleeps(mc)
    real = mc.transfer_check_status
    looks_at_bad = []

    def check(bid):
        if bid == 1001:
            looks_at_bad.append(bid)
            raise RuntimeError("status unreadable")
        return real(bid)
    mc.transfer_check_status = check
    eng = make_engine(mc)
    eng._inflight = Inflight(check)
    with pytest.raises(TransferError, match="status could not be read .*2 of its tasks still running") as e:
        eng.write("peer", RUNS, "data")
    assert e.value.stage == "data"
    assert wait_kept(eng) == 0 and mc.freed == {1000, 1002} and looks_at_bad == [1001]

    eng._inflight.adopt([1001])  # adopted anyway: the keeper lets it go and goes on
    assert wait_kept(eng) == 0 and looks_at_bad == [1001, 1001]
