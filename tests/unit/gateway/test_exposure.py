"""The gateway's start-up check (services/gateway/exposure.py): without API keys it starts on loopback only, unless
--allow-unauthenticated, which is then logged once. The real process refusing and starting:
tests/integration/test_gateway_exposure.py."""
from __future__ import annotations

import logging

import pytest

from pdserve.gateway.exposure import check_exposure, is_loopback
from pdserve.gateway.keys import ApiKeys

KEYS = ApiKeys({"sk-acme-key-0001": "acme"})


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LocalHost"])
def test_loopback_addresses(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "", "10.1.2.3", "192.168.0.1", "fe80::1", "my-host",
                                  "localhost.example.com", "127.0.0.1.nip.io", "::ffff:10.0.0.1"])
def test_every_other_address_and_every_name_is_beyond_loopback(host):
    assert not is_loopback(host)


@pytest.mark.parametrize("http_port", [8000, -1])
def test_no_key_beyond_loopback_is_refused_in_one_line_naming_the_ports_and_the_risk(http_port, caplog):
    with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as e:
        check_exposure("0.0.0.0", 50051, http_port, None, allowed=False)
    line = str(e.value.code)
    assert "\n" not in line and line.startswith("gateway: refusing to start: ")
    assert "gRPC API on 0.0.0.0:50051" in line and ("HTTP API on 0.0.0.0:8000" in line) == (http_port == 8000)
    assert "no API key" in line and "one prefix-cache scope" in line and "time to first token" in line
    assert "--api-keys-file" in line and "--allow-unauthenticated" in line
    assert caplog.records == []


@pytest.mark.parametrize("host,keys", [("127.0.0.1", None), ("0.0.0.0", KEYS), ("127.0.0.1", KEYS)])
def test_a_key_or_loopback_starts_and_logs_nothing(host, keys, caplog):
    with caplog.at_level(logging.INFO):
        assert check_exposure(host, 50051, 8000, keys, allowed=False) is None
    assert caplog.records == []


def test_allowed_it_starts_with_one_warning_naming_the_risk(caplog):
    with caplog.at_level(logging.INFO):
        check_exposure("0.0.0.0", 50051, 8000, None, allowed=True)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    msg = caplog.records[0].getMessage()
    assert "UNAUTHENTICATED (--allow-unauthenticated)" in msg and "gRPC API on 0.0.0.0:50051" in msg
    assert "one prefix-cache scope" in msg


@pytest.mark.parametrize("host,keys,why", [("127.0.0.1", None, "--host 127.0.0.1 is loopback"),
                                           ("0.0.0.0", KEYS, "API keys are required")])
def test_allowed_where_nothing_is_open_says_so(host, keys, why, caplog):
    with caplog.at_level(logging.INFO):
        check_exposure(host, 50051, 8000, keys, allowed=True)
    assert [r.getMessage() for r in caplog.records] == [f"gateway: --allow-unauthenticated given but {why}: "
                                                        "nothing to allow"]
