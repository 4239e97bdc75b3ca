"""--transfer-port: the two ports Mooncake is told to use, and the refusals where it would not use them."""
import os
import sys

import pytest

from pdserve.kvtransfer import engine
from pdserve.kvtransfer.engine import transfer_ports


@pytest.mark.parametrize("port", [1024, 15000, 32766, 61000, 65534])
def test_port_and_the_next(port):
    assert transfer_ports(port) == (port, port + 1)


@pytest.mark.parametrize("port", [80, 1023, 32767, 32768, 40000, 60999, 65535])
def test_ports_mooncake_would_replace_by_random_ones_are_refused(port):
    # Mooncake's ValidatePortRange falls back to 15000-17000 for these, without an error
    with pytest.raises(ValueError, match=f"--transfer-port {port}: .*{port + 1}"):
        transfer_ports(port)


def test_range_is_set_before_mooncake_reads_it(monkeypatch):
    monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)
    # set, then removed, through monkeypatch: its undo then removes what _pin_ports writes, so services this
    # test process starts later do not inherit a two-port range (every Mooncake after the first would fail)
    for name in ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT"):
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)
    assert engine._pin_ports(20000) == (20000, 20001)
    assert (os.environ["MC_MIN_RPC_PORT"], os.environ["MC_MAX_RPC_PORT"]) == ("20000", "20001")


def test_too_late_once_mooncake_is_imported(monkeypatch):
    # Mooncake reads its port range once, on import: a later setting would be ignored in silence
    monkeypatch.setitem(sys.modules, "mooncake.engine", object())
    monkeypatch.setenv("MC_MIN_RPC_PORT", "15000")
    monkeypatch.setenv("MC_MAX_RPC_PORT", "17000")
    with pytest.raises(RuntimeError, match="imported before its port range was set"):
        engine._pin_ports(20000)
    monkeypatch.setenv("MC_MIN_RPC_PORT", "20000")
    monkeypatch.setenv("MC_MAX_RPC_PORT", "20001")
    assert engine._pin_ports(20000) == (20000, 20001)  # already in force: nothing to refuse
