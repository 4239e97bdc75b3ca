"""The Grafana dashboard: datasource and namespace variables that every query uses, a legend on every
series, p50 beside every p99, every query valid PromQL (promtool parses it) over metrics the code exports."""
from __future__ import annotations

import json
import os
import re
import subprocess

import yaml

from tests.conftest import ROOT

DASHBOARD = os.path.join(ROOT, "deploy", "k8s", "monitoring", "dashboard.json")
DS = {"type": "prometheus", "uid": "${datasource}"}


def dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


def targets() -> list[tuple[str, dict]]:
    return [(p["title"], t) for p in dashboard()["panels"] for t in p["targets"]]


def exported_metrics() -> set[str]:
    names = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "services")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    names |= set(re.findall(r'"(pdserve_[a-z_]+)"', f.read()))
    return names


def test_datasource_and_namespace_variables():
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ns = variables["namespace"]
    assert ns["type"] == "query" and ns["datasource"] == DS and "namespace" in ns["definition"]
    # "All" must also match series without a namespace label (a Prometheus outside Kubernetes)
    assert ns["includeAll"] and ns["allValue"] == ".*"


def test_every_query_uses_the_variables_and_has_a_legend():
    for title, t in targets():
        assert t["datasource"] == DS, title
        assert 'namespace=~"$namespace"' in t["expr"], (title, t["expr"])
        assert t.get("legendFormat", "").strip(), f"{title}: {t['expr']} has no legend"
    for p in dashboard()["panels"]:
        assert p["datasource"] == DS, p["title"]


def test_p50_beside_every_p99():
    for p in dashboard()["panels"]:
        exprs = [t["expr"] for t in p["targets"]]
        p99 = [e for e in exprs if e.startswith("histogram_quantile(0.99,")]
        for e in p99:
            p50 = e.replace("histogram_quantile(0.99,", "histogram_quantile(0.5,", 1)
            assert p50 in exprs, f"{p['title']}: no p50 beside {e}"
            assert {t["legendFormat"] for t in p["targets"]} >= {"p50", "p99"}
    assert sum("histogram_quantile(0.99," in e for _, t in targets() for e in [t["expr"]]) >= 2


def test_every_query_is_promql_over_exported_metrics(tmp_path):
    known = exported_metrics() | {"up"}
    rules = []
    for i, (title, t) in enumerate(targets()):
        expr = t["expr"].replace("$namespace", ".*")
        for m in re.findall(r"\b(pdserve_[a-z_]+?)(?:_bucket|_sum|_count)?\b(?=\{)", expr):
            assert m in known, f"{title}: {m} is not exported by services/"
        rules.append({"record": f"dashboard:q{i}", "expr": expr})
    (tmp_path / "q.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run(["promtool", "check", "rules", str(tmp_path / "q.yml")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
