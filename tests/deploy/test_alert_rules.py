"""The shipped alert rules: promtool's unit tests (deploy/k8s/monitoring/tests) cover every alert, firing
and quiet, and every alert links a runbook that exists in docs/runbooks and names the alert's metrics."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import yaml

from tests.conftest import ROOT

MONITORING = os.path.join(ROOT, "deploy", "k8s", "monitoring")
RULES = os.path.join(MONITORING, "rules.yaml")
UNIT_TESTS = os.path.join(MONITORING, "tests", "rules_test.yaml")
RUNBOOKS = os.path.join(ROOT, "docs", "runbooks")
RUNBOOK_URL = "https://github.com/pdserve/pdserve/blob/main/docs/runbooks/{}.md"


def rules() -> list[dict]:
    with open(RULES) as f:
        return [r for g in yaml.safe_load(f)["spec"]["groups"] for r in g["rules"]]


def alerts() -> list[dict]:
    return [r for r in rules() if "alert" in r]


def watched_metrics(expr: str, records: dict[str, str]) -> set[str]:
    """The exported metrics an expression reads (a histogram by its name), through the recording rules it names."""
    names = {re.sub(r"_(bucket|count|sum)$", "", m)
             for m in re.findall(r"(?<![\w:])(pdserve_[a-z_]+|up)\b(?=\{|\[|\s|\))", expr)}
    for record, sub in records.items():
        if re.search(rf"(?<![\w:]){re.escape(record)}(?![\w:])", expr):
            names |= watched_metrics(sub, records)
    return names


def promtool_test(tmp_path, rules_doc: dict) -> subprocess.CompletedProcess:
    """promtool reads plain rule files, not the PrometheusRule around them: extract spec.groups beside a copy
    of the unit tests, whose rule_files names rules.yml."""
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": rules_doc["spec"]["groups"]}))
    shutil.copy(UNIT_TESTS, tmp_path / "rules_test.yaml")
    return subprocess.run(["promtool", "test", "rules", "rules_test.yaml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)


def test_promtool_unit_tests_pass(tmp_path):
    with open(RULES) as f:
        out = promtool_test(tmp_path, yaml.safe_load(f))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_unit_tests_fail_when_an_alert_is_weakened(tmp_path):
    """The tests bind the rules: a target-down alert for every job, not only pdserve's, fails them."""
    with open(RULES) as f:
        doc = yaml.safe_load(f)
    for g in doc["spec"]["groups"]:
        for r in g["rules"]:
            if r.get("alert") == "PdserveTargetDown":
                r["expr"] = "up == 0"
    out = promtool_test(tmp_path, doc)
    assert out.returncode != 0 and "PdserveTargetDown" in out.stdout + out.stderr, out.stdout + out.stderr


def test_every_alert_has_firing_and_quiet_unit_tests():
    with open(UNIT_TESTS) as f:
        cases = [c for t in yaml.safe_load(f)["tests"] for c in t.get("alert_rule_test", [])]
    names = {a["alert"] for a in alerts()}
    firing = {c["alertname"] for c in cases if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    assert names - firing == set(), f"alerts never tested firing: {sorted(names - firing)}"
    assert names - quiet == set(), f"alerts never tested quiet: {sorted(names - quiet)}"
    assert {"PdserveTargetDown", "PdserveDataLoss", "PdserveLeaseViolation", "PdserveUnsafeMode",
            "PdserveKvPoolSmallerThanContext", "PdserveQuarantineNotDraining", "PdserveTransferFailures",
            "PdserveTargetsAbsent", "PdserveErrorRatio", "PdserveTtftSloBurn", "PdserveOverloaded"} <= names


def test_target_down_and_data_loss_watch_what_the_issue_names():
    by_name = {a["alert"]: a for a in alerts()}
    assert re.fullmatch(r'up\{job="pdserve"\} == 0', by_name["PdserveTargetDown"]["expr"])
    assert 'pdserve_requests_total{code="DATA_LOSS"}' in by_name["PdserveDataLoss"]["expr"]
    assert "increase(" in by_name["PdserveDataLoss"]["expr"]


def test_every_alert_links_its_runbook_and_the_runbook_names_the_metrics():
    records = {r["record"]: r["expr"] for r in rules() if "record" in r}
    for a in alerts():
        name = a["alert"]
        assert a["annotations"]["runbook_url"] == RUNBOOK_URL.format(name)
        path = os.path.join(RUNBOOKS, f"{name}.md")
        assert os.path.exists(path), f"{name} links {path}, which does not exist"
        with open(path) as f:
            text = f.read()
        assert text.startswith(f"# {name}\n"), f"{path} does not start with '# {name}'"
        for section in ("## What it means", "## How to check", "## What to do"):
            assert section in text, f"{path} lacks '{section}'"
        metrics = watched_metrics(a["expr"], records)
        assert metrics, f"{name}: no metric found in {a['expr']!r}"
        for m in metrics:
            assert f"`{m}" in text, f"{path} never names the metric {m} its alert watches"


def test_the_ttft_objective_is_a_bucket_bound_the_gateway_exports():
    """le="5.0", as prometheus_client writes the bound 5 (a bound that is no bucket matches no series: the ratio would
    be empty and the burn alerts silent for ever)."""
    from prometheus_client.utils import floatToGoString

    from pdserve.common.metrics import TTFT
    exported = {floatToGoString(b) for b in TTFT._upper_bounds}
    bounds = {le for r in rules() for le in re.findall(r'pdserve_time_to_first_token_seconds_bucket\{le="([^"]+)"\}',
                                                      r["expr"])}
    assert bounds == {"5.0"} and bounds <= exported, (bounds, exported)


def test_absent_targets_name_every_service_the_service_monitor_scrapes():
    from tests.deploy.netpol import selects
    from tests.deploy.render import by_kind, render
    objs = render("cpu")
    monitor = by_kind(objs, "ServiceMonitor")["pdserve"]["spec"]
    scraped = {name for name, svc in by_kind(objs, "Service").items()
               if selects(monitor["selector"], svc["metadata"]["labels"])
               and any(p["name"] == "metrics" for p in svc["spec"]["ports"])}
    expr = next(a["expr"] for a in alerts() if a["alert"] == "PdserveTargetsAbsent")
    named = re.findall(r'absent\(up\{job="pdserve", service="([^"]+)"\}\)', expr)
    assert sorted(named) == sorted(scraped) and len(scraped) == 4, (named, scraped)
