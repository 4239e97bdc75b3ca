"""Named fault points (DESIGN §7): off by default, armed with a count and an argument."""
import os
import subprocess
import sys

import pytest

from pdserve.common.faults import KNOWN, FaultRegistry, faults_enabled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_unarmed_points_never_fire():
    r = FaultRegistry(enabled=True)
    assert all(r.fire(name) is None for name in KNOWN)
    assert r.fire("not.a.point") is None


def test_default_count_fires_once():
    r = FaultRegistry(enabled=True)
    r.arm("prefill.short_transfer")
    assert r.fire("prefill.short_transfer") == ""
    assert r.fire("prefill.short_transfer") is None


def test_count_two_fires_twice_then_stops():
    r = FaultRegistry(enabled=True)
    r.arm("prefill.skip_page", count=2, arg="3")
    assert [r.fire("prefill.skip_page") for _ in range(4)] == ["3", "3", None, None]


def test_count_zero_fires_until_clear():
    r = FaultRegistry(enabled=True)
    r.arm("prefill.bit_flip", count=0, arg="1")
    assert [r.fire("prefill.bit_flip") for _ in range(50)] == ["1"] * 50
    r.clear()
    assert r.fire("prefill.bit_flip") is None


def test_points_are_independent():
    r = FaultRegistry(enabled=True)
    r.arm("prefill.skip_tags", count=1)
    r.arm("prefill.lose_end_write", count=0)
    assert r.fire("prefill.lose_end_write") == ""
    assert r.fire("prefill.skip_tags") == ""
    assert r.fire("prefill.skip_tags") is None
    assert r.fire("prefill.lose_end_write") == ""


def test_rearm_replaces_count_and_arg():
    r = FaultRegistry(enabled=True)
    r.arm("decode.corrupt_tag", count=0, arg="0")
    r.arm("decode.corrupt_tag", count=1, arg="2")
    assert r.fire("decode.corrupt_tag") == "2"
    assert r.fire("decode.corrupt_tag") is None


def test_unknown_name_raises_and_lists_known():
    r = FaultRegistry(enabled=True)
    with pytest.raises(ValueError) as e:
        r.arm("prefill.short_transfers")
    assert "'prefill.short_transfers'" in str(e.value)
    assert "prefill.short_transfer'" in str(e.value)
    assert r.fire("prefill.short_transfers") is None


def test_load_env_parses_name_count_arg():
    r = FaultRegistry(enabled=True)
    r.load_env("prefill.short_transfer:1,prefill.skip_page:2:7, prefill.skip_tags,prefill.delay_before_write:0:250")
    assert r.fire("prefill.short_transfer") == ""
    assert r.fire("prefill.short_transfer") is None
    assert [r.fire("prefill.skip_page") for _ in range(3)] == ["7", "7", None]
    assert r.fire("prefill.skip_tags") == ""  # a bare name: count 1
    assert r.fire("prefill.skip_tags") is None
    assert [r.fire("prefill.delay_before_write") for _ in range(5)] == ["250"] * 5
    assert r.fire("prefill.bit_flip") is None


def test_load_env_empty_and_trailing_commas():
    r = FaultRegistry(enabled=True)
    r.load_env(None)
    r.load_env("")
    r.load_env("prefill.bit_flip::4,,")  # empty count means 1
    assert [r.fire("prefill.bit_flip") for _ in range(2)] == ["4", None]


def test_load_env_unknown_name_raises():
    with pytest.raises(ValueError, match="prefill.nope"):
        FaultRegistry(enabled=True).load_env("prefill.short_transfer:1,prefill.nope:1")


def test_load_env_bad_count_raises():
    with pytest.raises(ValueError):
        FaultRegistry(enabled=True).load_env("prefill.skip_page:two")


def _fresh_import(**env):
    full = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    full.update(env)
    code = ("from pdserve.common.faults import FAULTS, KNOWN, faults_enabled;"
            "print([FAULTS.fire('prefill.skip_page') for _ in range(3)],"
            " [n for n in sorted(KNOWN) if FAULTS.fire(n) is not None], faults_enabled())")
    return subprocess.run([sys.executable, "-c", code], env=full, cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=True).stdout.strip()


def test_global_registry_is_off_without_env():
    assert _fresh_import() == "[None, None, None] [] False"


def test_global_registry_reads_env_at_import():
    out = _fresh_import(PDSERVE_FAULTS="prefill.skip_page:2:5,prefill.skip_tags:0", PDSERVE_ENABLE_FAULTS="1")
    assert out == "['5', '5', None] ['prefill.skip_tags'] True"


def test_faults_enabled_only_for_exact_one(monkeypatch):
    for value, want in (("1", True), ("0", False), ("true", False), ("", False)):
        monkeypatch.setenv("PDSERVE_ENABLE_FAULTS", value)
        assert faults_enabled() is want
    monkeypatch.delenv("PDSERVE_ENABLE_FAULTS")
    assert faults_enabled() is False


def test_record_names_the_request_each_point_fired_on_and_each_violation_counted_for():
    r = FaultRegistry(enabled=True)
    r.arm("prefill.bit_flip", count=2, arg="1")
    a, b = bytes(range(16)), bytes(range(1, 17))
    assert r.fire("prefill.bit_flip", a) == "1"
    assert r.fire("prefill.skip_page", a) is None  # not armed: not recorded
    assert r.fire("prefill.bit_flip", b) == "1"
    assert r.fire("prefill.bit_flip", b) is None  # spent: not recorded
    r.counted("decode", "CHECKSUM_MISMATCH", b)
    fired, counted, dropped = r.take_record()
    assert [(f.name, f.owner, f.arg) for f in fired] == [("prefill.bit_flip", a, "1"), ("prefill.bit_flip", b, "1")]
    assert [(c.service, c.reason, c.owner) for c in counted] == [("decode", "CHECKSUM_MISMATCH", b)]
    assert dropped == 0
    assert r.take_record() == ([], [], 0)  # taken: forgotten


def test_record_keeps_the_newest_entries_and_counts_what_it_dropped(monkeypatch):
    monkeypatch.setattr("pdserve.common.faults.RECORD_LIMIT", 3)
    r = FaultRegistry(enabled=True)
    for i in range(5):
        r.counted("broker", "LEASE_NOT_CURRENT", bytes([i]) * 16)
    _, counted, dropped = r.take_record()
    assert [c.owner[0] for c in counted] == [2, 3, 4] and dropped == 2


def test_nothing_is_recorded_with_the_switch_off():
    r = FaultRegistry(enabled=False)
    r.counted("decode", "REVOKED", bytes(16))
    assert r.fire("prefill.bit_flip", bytes(16)) is None
    assert r.take_record() == ([], [], 0)
