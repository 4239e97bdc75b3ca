"""Every overlay renders with a real kubectl and validates offline against Kubernetes 1.30 and 1.37 (and the
vendored prometheus-operator CRD schemas); the rendered objects keep the rules of issue 10."""
from __future__ import annotations

import copy
import re

import pytest

from tests.deploy.render import (K8S_VERSIONS, OVERLAYS, by_kind, containers, flag, render, validate, workloads)

ROLES = ("broker", "prefill", "decode", "gateway")
GRPC_PORTS = {"gateway": 50051, "broker": 50052, "prefill": 50053, "decode": 50054}


def version() -> str:
    with open("pyproject.toml") as f:
        return re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)


def deployment(overlay: str, role: str) -> dict:
    return by_kind(render(overlay), "Deployment")[f"pdserve-{role}"]


@pytest.mark.parametrize("k8s", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay, k8s):
    objs = render(overlay)
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "Service", "ServiceAccount", "PodDisruptionBudget", "NetworkPolicy", "ConfigMap",
            "PrometheusRule", "ServiceMonitor"} <= kinds, kinds
    errors = [e for o in objs for e in validate(o, k8s)]
    assert errors == []


@pytest.mark.parametrize("k8s", K8S_VERSIONS)
def test_validation_rejects_a_misspelt_field_in_a_core_kind_and_in_a_crd(k8s):
    objs = render("cpu")
    dep = copy.deepcopy(deployment("cpu", "decode"))
    dep["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["periodSecond"] = 5
    assert any("periodSecond" in e for e in validate(dep, k8s))
    sm = copy.deepcopy(by_kind(objs, "ServiceMonitor")["pdserve"])
    sm["spec"]["endpoints"][0]["honorLabel"] = True
    assert any("honorLabel" in e for e in validate(sm, k8s))
    rule = copy.deepcopy(by_kind(objs, "PrometheusRule")["pdserve"])
    rule["spec"]["groups"][0]["rules"][0]["expresion"] = "1"
    assert any("expresion" in e for e in validate(rule, k8s))
    unknown = {"apiVersion": "example.com/v1", "kind": "Gadget", "metadata": {"name": "x"}}
    assert validate(unknown, k8s), "an unknown kind must not pass unvalidated"


@pytest.mark.parametrize("overlay,variant", [("cpu", "cpu"), ("gpu", "cuda")])
def test_images_carry_the_pyproject_version_and_are_not_pulled_every_start(overlay, variant):
    for w in workloads(render(overlay)):
        for c in containers(w) + containers(w, init=True):
            assert c["image"] == f"ghcr.io/pdserve/pdserve:{version()}-{variant}", (w["metadata"]["name"], c["image"])
            assert c["imagePullPolicy"] == "IfNotPresent"


def health_args(probe: dict) -> list[str]:
    cmd = probe["exec"]["command"]
    assert cmd[:2] == ["pdserve", "health"], cmd
    return cmd[2:]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_startup_readiness_and_liveness_probes_on_its_own_port(overlay):
    for role in ROLES:
        c = containers(deployment(overlay, role))[0]
        port = str(GRPC_PORTS[role])
        assert {"name": "grpc", "containerPort": GRPC_PORTS[role]} in c["ports"]
        for kind in ("startupProbe", "readinessProbe"):
            args = health_args(c[kind])
            assert "--live" not in args and flag(args, "--port") == port, (role, kind, args)
        live = health_args(c["livenessProbe"])
        assert "--live" in live and flag(live, "--port") == port
        assert "initialDelaySeconds" not in c["livenessProbe"], "the startupProbe gates liveness"
        if role != "gateway":  # the gateway's public port is plaintext; every other probe presents the pod's cert
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                args = health_args(c[kind])
                assert flag(args, "--tls-role") == role and flag(args, "--server-name") == f"pdserve-{role}"


@pytest.mark.parametrize("overlay,minimum_s", [("cpu", 120), ("gpu", 900)])
def test_startup_probes_allow_for_model_load(overlay, minimum_s):
    for role in ("prefill", "decode"):
        p = containers(deployment(overlay, role))[0]["startupProbe"]
        assert p["periodSeconds"] * p["failureThreshold"] >= minimum_s, (role, p)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_non_root_with_runtime_default_seccomp_and_no_token(overlay):
    objs = render(overlay)
    for w in workloads(objs):
        spec = w["spec"]["template"]["spec"]
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        for c in containers(w) + containers(w, init=True):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
    for sa in by_kind(objs, "ServiceAccount").values():
        assert sa["automountServiceAccountToken"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_broker_is_a_recreated_singleton_without_a_model(overlay):
    b = deployment(overlay, "broker")
    assert b["spec"]["replicas"] == 1 and b["spec"]["strategy"] == {"type": "Recreate"}
    spec = b["spec"]["template"]["spec"]
    assert "models" not in {v["name"] for v in spec["volumes"]}
    assert "--model" not in spec["containers"][0]["args"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_drain_timings_fit_the_grace_period(overlay):
    expected = {"decode": "25", "prefill": "10", "gateway": "25"}
    for role, drain in expected.items():
        spec = deployment(overlay, role)["spec"]["template"]["spec"]
        c = spec["containers"][0]
        assert flag(c["args"], "--drain-timeout") == drain
        sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert 1 <= sleep <= 10
        # preStop, then SIGTERM and the drain, then a margin for leases to be released before SIGKILL
        assert spec["terminationGracePeriodSeconds"] >= sleep + int(drain) + 5, (role, spec["terminationGracePeriodSeconds"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_volumes_are_defined_and_claims_exist(overlay):
    objs = render(overlay)
    claims = set(by_kind(objs, "PersistentVolumeClaim"))
    for w in workloads(objs):
        spec = w["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in containers(w) + containers(w, init=True):
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, (w["metadata"]["name"], c["name"], m)
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, v
        # the certificate is the pod's own (its attributes: test_pod_identity.py)
        assert volumes["tls"]["csi"]["driver"] == "csi.cert-manager.io"
        tls = [m for m in containers(w)[0]["volumeMounts"] if m["name"] == "tls"]
        assert tls == [{"name": "tls", "mountPath": "/etc/pdserve/tls", "readOnly": True}]
