"""The Grafana dashboard: datasource and namespace variables that every query uses, a legend on every
series, p50 beside every p99, every query valid PromQL (promtool parses it) over metrics the code exports."""
from __future__ import annotations

import json
import os

from tests.conftest import ROOT
from tests.deploy.promql import check_queries

DASHBOARD = os.path.join(ROOT, "deploy", "k8s", "monitoring", "dashboard.json")
DS = {"type": "prometheus", "uid": "${datasource}"}


def dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


def targets() -> list[tuple[str, dict]]:
    return [(p["title"], t) for p in dashboard()["panels"] for t in p["targets"]]


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
    check_queries([(title, t["expr"].replace("$namespace", ".*")) for title, t in targets()], tmp_path)


def test_the_panels_to_scale_and_page_on_are_there():
    """Issue 21: tokens per second (prompt and generated side by side), HTTP requests by route and status, requests
    running and waiting by service, and the queue times."""
    panels = {p["title"]: [t["expr"] for t in p["targets"]] for p in dashboard()["panels"]}

    def panel_with(*needles: str) -> str:
        found = [title for title, exprs in panels.items() if all(any(n in e for e in exprs) for n in needles)]
        assert found, f"no panel reads all of {needles}"
        return found[0]
    assert "per second" in panel_with("rate(pdserve_prompt_tokens_total{", "rate(pdserve_generation_tokens_total{")
    panel_with("sum by (route, status) (rate(pdserve_http_requests_total{")
    panel_with("sum by (service) (pdserve_requests_running{")
    panel_with("sum by (service) (pdserve_requests_waiting{")
    for service in ("prefill", "decode"):
        panel_with(f'pdserve_queue_time_seconds_bucket{{namespace=~"$namespace", service="{service}"}}')
