"""Unsafe modes need `--allow-unsafe MODE`, are logged at ERROR and exported as pdserve_unsafe_mode (issue 9, hole 10)."""
import argparse
import asyncio
import logging

import pytest
from prometheus_client import REGISTRY

from pdserve.common import unsafe
from pdserve.common.cli_args import add_engine_args
from pdserve.common.unsafe import MODES, UnsafeModeRefused, check_unsafe, enable_unsafe, modes_in_use


def gauge(service: str, mode: str):
    return REGISTRY.get_sample_value("pdserve_unsafe_mode", {"service": service, "mode": mode})


def engine_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p, "prefill", 0, 1024)
    return p.parse_args(list(argv))


@pytest.fixture(autouse=True)
def faults_off(monkeypatch):
    monkeypatch.setattr(unsafe.FAULTS, "enabled", False)


def test_every_known_mode_exists_at_zero_from_start():
    assert enable_unsafe("t-none", [], []) == []
    assert {m: gauge("t-none", m) for m in MODES} == {m: 0.0 for m in MODES}
    assert set(MODES) >= {"no-transfer-checksum", "insecure", "faults"}


def test_switch_without_opt_in_refuses_naming_flag_guard_and_opt_in():
    with pytest.raises(UnsafeModeRefused) as e:
        enable_unsafe("t-refuse", ["no-transfer-checksum"], [])
    msg = str(e.value)
    assert msg.startswith("t-refuse: refusing to start: --no-transfer-checksum removes the page checksum"), msg
    assert "--allow-unsafe no-transfer-checksum" in msg and "MUT_NO_CHECKSUM" in msg
    assert gauge("t-refuse", "no-transfer-checksum") == 0.0


def test_opt_in_for_another_mode_does_not_count():
    with pytest.raises(UnsafeModeRefused, match="--insecure"):
        enable_unsafe("t-other", ["insecure", "no-transfer-checksum"], ["no-transfer-checksum"])


def test_opt_in_logs_at_error_and_sets_the_gauge(caplog):
    with caplog.at_level(logging.ERROR, logger="pdserve.common.unsafe"):
        used = enable_unsafe("t-on", ["no-transfer-checksum"], ["no-transfer-checksum"])
    assert used == ["no-transfer-checksum"]
    assert {m: gauge("t-on", m) for m in MODES} == {"no-transfer-checksum": 1.0, "insecure": 0.0, "faults": 0.0}
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "UNSAFE MODE no-transfer-checksum" in errors[0] and "t-on" in errors[0], errors


def test_faults_switch_is_its_own_opt_in():
    assert enable_unsafe("t-faults", ["faults"], []) == ["faults"]
    assert gauge("t-faults", "faults") == 1.0 and gauge("t-faults", "no-transfer-checksum") == 0.0


def test_modes_in_use_reads_flags_and_the_fault_switch(monkeypatch):
    assert modes_in_use(engine_args()) == []
    assert modes_in_use(engine_args("--no-transfer-checksum")) == ["no-transfer-checksum"]
    assert modes_in_use(argparse.Namespace(insecure=True)) == ["insecure"]
    monkeypatch.setattr(unsafe.FAULTS, "enabled", True)
    assert modes_in_use(argparse.Namespace()) == ["faults"]


def test_allow_unsafe_is_repeatable_and_checked_by_argparse(capsys):
    args = engine_args("--allow-unsafe", "no-transfer-checksum", "--allow-unsafe", "insecure")
    assert args.allow_unsafe == ["no-transfer-checksum", "insecure"]
    for bad in ("no-checksum", "faults", "no-transfer-checksum,insecure"):
        with pytest.raises(SystemExit):
            engine_args("--allow-unsafe", bad)
    assert "invalid choice" in capsys.readouterr().err


def test_check_unsafe_on_parsed_flags():
    async def run(*argv):
        return check_unsafe("t-check", engine_args(*argv), every_s=3600)

    with pytest.raises(UnsafeModeRefused, match="--allow-unsafe no-transfer-checksum"):
        asyncio.run(run("--no-transfer-checksum"))
    assert asyncio.run(run("--no-transfer-checksum", "--allow-unsafe", "no-transfer-checksum")) == \
        ["no-transfer-checksum"]
    assert gauge("t-check", "no-transfer-checksum") == 1.0


def test_reminder_repeats_the_error(caplog):
    async def run():
        task = asyncio.ensure_future(unsafe.remind("t-remind", ["no-transfer-checksum"], every_s=0.01))
        await asyncio.sleep(0.2)
        task.cancel()

    with caplog.at_level(logging.ERROR, logger="pdserve.common.unsafe"):
        asyncio.run(run())
    errors = [r.getMessage() for r in caplog.records if "t-remind: UNSAFE MODE no-transfer-checksum" in r.getMessage()]
    assert len(errors) >= 3, errors
