"""Unsafe switches on real service processes (issue 9, hole 10): refused without the opt-in, exported with it;
fault switches in the parent's environment do not reach a launched service; /metrics binds 127.0.0.1 by default."""
import re
import subprocess
import sys
import urllib.request

import grpc
import pytest

from pdserve import launcher
from pdserve.common.pki import issue
from pdserve.common.proto import faults_pb2, faults_pb2_grpc
from pdserve.common.tls import TlsConfig, secure_channel

CHECKSUM_OFF = ["--no-transfer-checksum"]
OPT_IN = ["--allow-unsafe", "no-transfer-checksum"]


def unsafe_gauges(proc: launcher.Proc) -> dict[str, float]:
    """mode -> value of pdserve_unsafe_mode, scraped from the service's /metrics on 127.0.0.1."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^pdserve_unsafe_mode\{(.*)\} (\S+)$', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            assert labels["service"] == proc.args[0], line
            out[labels["mode"]] = float(m.group(2))
    return out


def listening_addresses(port: int) -> set[str]:
    """Local addresses of the TCP sockets listening on `port`, from /proc/net/tcp{,6} (hex, kernel byte order)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                addr, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(addr)
    return found


LOOPBACK, ANY = "0100007F", "00000000"


def tls_args(tls_dir, identity: str) -> list[str]:
    f = issue(str(tls_dir), identity)
    return ["--tls-cert", f.cert, "--tls-key", f.key, "--tls-ca", f.ca]


@pytest.mark.parametrize("service", ["prefill", "decode"])
def test_no_transfer_checksum_without_opt_in_refuses_to_start(model_dir, service):
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", service, "--model", model_dir, "--port", "0",
                        "--metrics-port", "0", "--broker", "127.0.0.1:1", *CHECKSUM_OFF],
                       capture_output=True, text=True, timeout=120)
    err = r.stderr + r.stdout
    assert r.returncode != 0, err
    assert f"{service}: refusing to start: --no-transfer-checksum removes the page checksum" in err, err
    assert "--allow-unsafe no-transfer-checksum" in err
    assert "PDSERVE_READY" not in r.stdout


def test_opt_in_serves_and_exports_the_mode_parent_fault_switches_stay_behind(model_dir, monkeypatch, tmp_path):
    # a shell with the test-only switches exported: `pdserve up` from it must not arm anything
    monkeypatch.setenv("PDSERVE_ENABLE_FAULTS", "1")
    monkeypatch.setenv("PDSERVE_FAULTS", "prefill.short_transfer:0")
    procs = []
    try:
        broker = launcher.start("broker", ["broker", "--port", "0", "--metrics-port", "0",
                                           *tls_args(tmp_path, "broker/b0")])
        procs.append(broker)
        prefill = launcher.start("prefill", ["prefill", "--model", model_dir, "--port", "0", "--metrics-port", "0",
                                             "--broker", broker.target, *CHECKSUM_OFF, *OPT_IN,
                                             *tls_args(tmp_path, "prefill/p0")])
        procs.append(prefill)
        assert unsafe_gauges(prefill) == {"no-transfer-checksum": 1.0, "insecure": 0.0, "faults": 0.0}
        assert unsafe_gauges(broker) == {"no-transfer-checksum": 0.0, "insecure": 0.0, "faults": 0.0}
        log = "".join(prefill.lines)
        assert re.search(r"ERROR pdserve\.common\.unsafe: prefill: UNSAFE MODE no-transfer-checksum", log), log
        assert "PDSERVE_FAULTS" not in log and "fault point" not in log, log
        # the test-only Faults service is not served: only a switch passed explicitly turns it on
        op = issue(str(tmp_path), "operator/t")
        with secure_channel(prefill.target, TlsConfig(op.cert, op.key, op.ca), aio=False) as ch, \
                pytest.raises(grpc.RpcError) as e:
            faults_pb2_grpc.FaultsStub(ch).Arm(faults_pb2.ArmRequest(name="prefill.short_transfer"), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        for p in procs:
            assert listening_addresses(p.metrics_port) == {LOOPBACK}, p.name
    finally:
        for p in procs:
            launcher.stop(p)


def test_fault_switch_passed_explicitly_is_exported(monkeypatch, tmp_path):
    monkeypatch.delenv("PDSERVE_ENABLE_FAULTS", raising=False)
    broker = launcher.start("broker", ["broker", "--port", "0", "--metrics-port", "0", "--metrics-host", "0.0.0.0",
                                       *tls_args(tmp_path, "broker/b0")], env={"PDSERVE_ENABLE_FAULTS": "1"})
    try:
        assert unsafe_gauges(broker) == {"no-transfer-checksum": 0.0, "insecure": 0.0, "faults": 1.0}
        assert re.search(r"ERROR pdserve\.common\.unsafe: broker: UNSAFE MODE faults", "".join(broker.lines))
        # the flag is passed through: the same check that saw 127.0.0.1 above now sees every address
        assert listening_addresses(broker.metrics_port) == {ANY}
    finally:
        launcher.stop(broker)

