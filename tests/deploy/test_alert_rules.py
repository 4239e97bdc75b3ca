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


def alerts() -> list[dict]:
    with open(RULES) as f:
        groups = yaml.safe_load(f)["spec"]["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


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
            "PdserveKvPoolSmallerThanContext", "PdserveQuarantineNotDraining", "PdserveTransferFailures"} <= names


def test_target_down_and_data_loss_watch_what_the_issue_names():
    by_name = {a["alert"]: a for a in alerts()}
    assert re.fullmatch(r'up\{job="pdserve"\} == 0', by_name["PdserveTargetDown"]["expr"])
    assert 'pdserve_requests_total{code="DATA_LOSS"}' in by_name["PdserveDataLoss"]["expr"]
    assert "increase(" in by_name["PdserveDataLoss"]["expr"]


def test_every_alert_links_its_runbook_and_the_runbook_names_the_metrics():
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
        metrics = set(re.findall(r"\b(pdserve_[a-z_]+|up)\b(?=\{|\[|\s|\))", a["expr"]))
        assert metrics, f"{name}: no metric found in {a['expr']!r}"
        for m in metrics:
            assert f"`{m}" in text, f"{path} never names the metric {m} its alert watches"
