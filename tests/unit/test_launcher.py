"""The launcher never passes the test-only fault switches on from its own environment (issue 9, hole 10)."""
from pdserve.launcher import child_env

PARENT = {"PATH": "/usr/bin", "HOME": "/home/x", "PDSERVE_ENABLE_FAULTS": "1",
          "PDSERVE_FAULTS": "prefill.short_transfer:0", "PDSERVE_OTHER": "kept"}


def test_parent_fault_switches_do_not_reach_the_child():
    assert child_env(None, PARENT) == {"PATH": "/usr/bin", "HOME": "/home/x", "PDSERVE_OTHER": "kept"}
    assert child_env({"GLOG_minloglevel": "2"}, PARENT) == {
        "PATH": "/usr/bin", "HOME": "/home/x", "PDSERVE_OTHER": "kept", "GLOG_minloglevel": "2"}


def test_switches_named_by_the_caller_do_reach_the_child():
    env = child_env({"PDSERVE_ENABLE_FAULTS": "1"}, PARENT)
    assert env["PDSERVE_ENABLE_FAULTS"] == "1" and "PDSERVE_FAULTS" not in env
    env = child_env({"PDSERVE_ENABLE_FAULTS": "1", "PDSERVE_FAULTS": "prefill.skip_tags:1"}, PARENT)
    assert env["PDSERVE_FAULTS"] == "prefill.skip_tags:1"


def test_default_parent_is_this_process(monkeypatch):
    monkeypatch.setenv("PDSERVE_ENABLE_FAULTS", "1")
    monkeypatch.setenv("PDSERVE_FAULTS", "prefill.bit_flip:0")
    monkeypatch.setenv("PDSERVE_LAUNCHER_PROBE", "yes")
    env = child_env(None)
    assert env["PDSERVE_LAUNCHER_PROBE"] == "yes"
    assert "PDSERVE_ENABLE_FAULTS" not in env and "PDSERVE_FAULTS" not in env
