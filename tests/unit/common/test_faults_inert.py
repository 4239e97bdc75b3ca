"""Fault points are inert unless the test-only switch PDSERVE_ENABLE_FAULTS=1 is on (issue 9, hole 10)."""
import logging
import os
import subprocess
import sys

import pytest

from pdserve.common.faults import KNOWN, FaultRegistry, FaultsDisabled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
EVERY_POINT = ",".join(f"{name}:0:1" for name in sorted(KNOWN))


def test_env_is_ignored_and_logged_when_the_switch_is_off(caplog):
    r = FaultRegistry(enabled=False)
    with caplog.at_level(logging.ERROR, logger="pdserve.common.faults"):
        r.load_env(EVERY_POINT)
    assert [name for name in sorted(KNOWN) for _ in range(3) if r.fire(name) is not None] == []
    errors = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.ERROR]
    assert len(errors) == 1 and "ignored" in errors[0] and "PDSERVE_ENABLE_FAULTS" in errors[0], errors
    assert "prefill.short_transfer:0:1" in errors[0]


def test_same_env_fires_when_the_switch_is_on():
    """The control for the test above: the same value arms every point once the switch is on."""
    r = FaultRegistry(enabled=True)
    r.load_env(EVERY_POINT)
    assert [name for name in sorted(KNOWN) if r.fire(name) == "1"] == sorted(KNOWN)


def test_arm_refuses_when_the_switch_is_off():
    r = FaultRegistry(enabled=False)
    with pytest.raises(FaultsDisabled, match="PDSERVE_ENABLE_FAULTS") as e:
        r.arm("prefill.short_transfer", count=0)
    assert "prefill.short_transfer" in str(e.value)
    assert r.fire("prefill.short_transfer") is None


def test_fire_is_none_when_off_even_if_something_was_armed():
    """A registry switched off after arming (nothing does that today) still never fires."""
    r = FaultRegistry(enabled=True)
    r.arm("prefill.bit_flip", count=0, arg="2")
    r.enabled = False
    assert [r.fire("prefill.bit_flip") for _ in range(3)] == [None, None, None]


def _fresh_import(**env):
    full = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    full.update(env)
    code = ("from pdserve.common.faults import FAULTS, KNOWN;"
            "print(FAULTS.enabled, [n for n in sorted(KNOWN) for _ in range(2) if FAULTS.fire(n) is not None])")
    return subprocess.run([sys.executable, "-c", code], env=full, cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=True)


@pytest.mark.parametrize("switch", [None, "0", "true", "yes"])
def test_global_registry_ignores_env_without_the_exact_switch(switch):
    env = {"PDSERVE_FAULTS": EVERY_POINT}
    if switch is not None:
        env["PDSERVE_ENABLE_FAULTS"] = switch
    r = _fresh_import(**env)
    assert r.stdout.strip() == "False []"
    assert "PDSERVE_FAULTS" in r.stderr and "ignored" in r.stderr, r.stderr


def test_global_registry_arms_env_with_the_switch():
    r = _fresh_import(PDSERVE_FAULTS="prefill.skip_tags:0,prefill.skip_page:1", PDSERVE_ENABLE_FAULTS="1")
    assert r.stdout.strip() == "True ['prefill.skip_page', 'prefill.skip_tags', 'prefill.skip_tags']"
