"""The autoscaling component (deploy/k8s/components/autoscaling, issue 21): KEDA ScaledObjects for gateway, prefill
and decode that render and validate with either overlay, hand the replica count to the HPA, read metrics the code
exports with PromQL that parses, and stay on the safe side when Prometheus cannot answer. Their queries run against
a real Prometheus over a real stack in tests/integration/test_prometheus.py."""
from __future__ import annotations

import copy
import re

import pytest

from tests.deploy.promql import check_queries
from tests.deploy.render import K8S_VERSIONS, OVERLAYS, by_kind, render, render_with, validate

SCALED = ("gateway", "prefill", "decode")
# the Prometheus scaler's trigger metadata keys in KEDA v2.20.2 (pkg/scalers/prometheus_scaler.go, prometheusMetadata;
# schemas/SOURCE.md): the CRD takes any string map, KEDA refuses what it does not know only at run time
PROMETHEUS_KEYS = {"serverAddress", "query", "queryParameters", "threshold", "activationThreshold", "namespace",
                   "customHeaders", "ignoreNullValues", "unsafeSsl", "awsRegion", "timeout", "identityOwner"}
PROMETHEUS_REQUIRED = {"serverAddress", "query", "threshold"}
NAMESPACE = "pdserve"  # where docs/kubernetes.md applies the overlays; the queries name it


@pytest.fixture(scope="module", params=OVERLAYS)
def scaled(request, tmp_path_factory):
    overlay = request.param
    return overlay, render_with(overlay, ["autoscaling"], tmp_path_factory.mktemp(overlay))


def scaled_objects(objs) -> dict[str, dict]:
    return by_kind(objs, "ScaledObject")


def triggers(objs):
    for name, so in scaled_objects(objs).items():
        for t in so["spec"]["triggers"]:
            yield name, t


@pytest.mark.parametrize("k8s", K8S_VERSIONS)
def test_each_overlay_with_the_component_renders_and_validates(scaled, k8s):
    _, objs = scaled
    errors = [e for o in objs for e in validate(o, k8s)]
    assert errors == []
    assert set(scaled_objects(objs)) == {f"pdserve-{r}" for r in SCALED}


def test_the_hpa_owns_the_replicas_of_exactly_the_scaled_deployments(scaled):
    overlay, objs = scaled
    deps = by_kind(objs, "Deployment")
    targets = {so["spec"]["scaleTargetRef"]["name"] for so in scaled_objects(objs).values()}
    assert targets == {f"pdserve-{r}" for r in SCALED} and targets <= set(deps)
    for name, d in deps.items():
        # a replicas field left in would reset the HPA's count at every apply; the broker stays a singleton
        assert ("replicas" in d["spec"]) == (name not in targets), name
    assert deps["pdserve-broker"]["spec"]["replicas"] == 1
    plain = by_kind(render(overlay), "Deployment")
    for name in targets:  # nothing else of the Deployment changes
        want = copy.deepcopy(plain[name])
        del want["spec"]["replicas"]
        assert deps[name] == want, name


def test_the_gateway_keeps_two_replicas_and_roles_scale_within_bounds(scaled):
    _, objs = scaled
    sos = scaled_objects(objs)
    base = by_kind(render("cpu"), "Deployment")
    assert sos["pdserve-gateway"]["spec"]["minReplicaCount"] == base["pdserve-gateway"]["spec"]["replicas"] == 2
    for name, so in sos.items():
        spec = so["spec"]
        assert 1 <= spec["minReplicaCount"] < spec["maxReplicaCount"], name
        # Prometheus unreachable: never fewer replicas than now (KEDA's default would be the fixed fallback count)
        assert spec["fallback"]["behavior"] == "currentReplicasIfHigher", name
        assert spec["fallback"]["replicas"] == spec["minReplicaCount"], name


def test_every_trigger_is_a_prometheus_query_keda_reads(scaled):
    _, objs = scaled
    found = 0
    for name, t in triggers(objs):
        role = name.removeprefix("pdserve-")
        meta = t["metadata"]
        assert t["type"] == "prometheus" and t["metricType"] == "AverageValue", name
        assert PROMETHEUS_REQUIRED <= set(meta) <= PROMETHEUS_KEYS, (name, sorted(meta))
        assert all(isinstance(v, str) for v in meta.values()), name  # the CRD's map is of strings
        assert float(meta["threshold"]) > 0
        # an empty answer is an error (then the fallback holds), never a 0 that scales down
        assert meta["ignoreNullValues"] == "false"
        assert meta["serverAddress"].startswith("http://prometheus-operated.")
        q = meta["query"]
        # the role's own in-flight load, in the documented namespace, from raw series (not recording rules)
        for gauge in ("pdserve_requests_running", "pdserve_requests_waiting"):
            assert f'{gauge}{{namespace="{NAMESPACE}", service="{role}"}}' in q, (name, q)
        assert ":" not in re.sub(r'"[^"]*"', "", q), f"{name} reads a recording rule: {q}"
        found += 1
    assert found == len(SCALED)


def test_every_query_parses_and_names_only_exported_metrics(scaled, tmp_path):
    _, objs = scaled
    check_queries([(name, t["metadata"]["query"]) for name, t in triggers(objs)], tmp_path)


@pytest.mark.parametrize("k8s", K8S_VERSIONS)
def test_validation_rejects_a_misspelt_scaled_object(scaled, k8s):
    _, objs = scaled
    so = copy.deepcopy(scaled_objects(objs)["pdserve-decode"])
    so["spec"]["minReplicas"] = 1
    assert any("minReplicas" in e for e in validate(so, k8s))
    so = copy.deepcopy(scaled_objects(objs)["pdserve-decode"])
    so["spec"]["fallback"]["behavior"] = "currentReplicasIfHiger"
    assert any("currentReplicasIfHiger" in e for e in validate(so, k8s))
