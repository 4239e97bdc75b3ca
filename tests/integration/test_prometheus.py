"""A real Prometheus scrapes the services and evaluates the shipped alert rules (deploy/k8s/monitoring)."""
import json
import os
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from tests.conftest import ROOT
from tests.integration.helpers import prompt

RULES = os.path.join(ROOT, "deploy", "k8s", "monitoring", "rules.yaml")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prometheus(stack, tmp_path):
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": yaml.safe_load(open(RULES))["spec"]["groups"]}))
    check = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    targets = [f"127.0.0.1:{p.metrics_port}" for ps in stack.procs.values() for p in ps]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [{"job_name": "pdserve", "static_configs": [{"targets": targets}]}]}))
    port = free_port()
    proc = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


def query(base: str, expr: str) -> list:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        return json.load(urllib.request.urlopen(url, timeout=2))["data"]["result"]
    except OSError:
        return []


def wait_query(base: str, expr: str, timeout: float = 30) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = query(base, expr)
        if r:
            return r
        time.sleep(0.5)
    raise AssertionError(f"{expr} returned nothing within {timeout}s")


def test_prometheus_sees_counters_at_zero_then_fires_the_violation_alert(stack, prometheus):
    up = wait_query(prometheus, 'count(up{job="pdserve"} == 1) == 4')
    assert up
    zero = wait_query(prometheus, 'pdserve_lease_violations_total{service="decode", reason="CHECKSUM"}')
    base = float(zero[0]["value"][1])
    stack.arm("prefill", "prefill.bit_flip", arg="0")
    out = stack.generate(prompt_token_ids=prompt(40, 77), max_tokens=4, ignore_eos=True)
    assert out["error"]["reason"] == "CHECKSUM" and out["token_ids"] == []
    wait_query(prometheus, f'pdserve_lease_violations_total{{service="decode", reason="CHECKSUM"}} > {base}')
    firing = wait_query(prometheus, 'ALERTS{alertname="PdserveLeaseViolation", alertstate="firing"}')
    assert {a["metric"]["reason"] for a in firing} >= {"CHECKSUM"}


def test_prometheus_fires_the_unsafe_mode_alert_for_the_test_fault_switch(stack, prometheus):
    """The test stack runs with PDSERVE_ENABLE_FAULTS=1, an unsafe mode: every service exports it and alerts."""
    firing = wait_query(prometheus, 'count(ALERTS{alertname="PdserveUnsafeMode", alertstate="firing"}) == 4')
    assert firing
    alerts = query(prometheus, 'ALERTS{alertname="PdserveUnsafeMode", alertstate="firing"}')
    assert {(a["metric"]["service"], a["metric"]["mode"]) for a in alerts} == {
        (s, "faults") for s in ("gateway", "broker", "prefill", "decode")}
    off = query(prometheus, 'pdserve_unsafe_mode{mode!="faults"}')
    assert len(off) >= 8 and {float(r["value"][1]) for r in off} == {0.0}
