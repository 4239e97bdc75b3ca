"""How the rendered pieces connect: per-pod Services, ports, disruption budgets, network policies, model
storage per overlay, and the monitoring objects' selectors and release label."""
from __future__ import annotations

import os
import re
import textwrap

import pytest

from tests.conftest import ROOT
from tests.deploy.netpol import Pod, allowed, selects
from tests.deploy.render import K8S, OVERLAYS, by_kind, containers, kustomize, render, workloads

ROLES = ("broker", "prefill", "decode", "gateway")


def labels(role: str) -> dict:
    return {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": role}


def pod(objs, role: str) -> Pod:
    c = containers(by_kind(objs, "Deployment")[f"pdserve-{role}"])[0]
    return Pod(labels(role), ports={p["name"]: p["containerPort"] for p in c["ports"]})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_deployments_select_their_own_pods_and_services_reach_them(overlay):
    objs = render(overlay)
    deps, svcs = by_kind(objs, "Deployment"), by_kind(objs, "Service")
    for role in ROLES:
        d = deps[f"pdserve-{role}"]
        assert d["spec"]["template"]["metadata"]["labels"] == labels(role)
        assert selects(d["spec"]["selector"], labels(role))
        assert svcs[f"pdserve-{role}"]["spec"]["selector"] == labels(role)
    gw = pod(objs, "gateway")
    assert gw.ports["http"] == 8000 and gw.ports["grpc"] == 50051
    gw_ports = {p["name"]: (p["port"], p["targetPort"]) for p in svcs["pdserve-gateway"]["spec"]["ports"]}
    assert gw_ports["http"] == (8000, "http") and gw_ports["grpc"] == (50051, "grpc")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prefill_and_decode_are_addressed_per_pod(overlay):
    objs = render(overlay)
    svcs = by_kind(objs, "Service")
    for role, port in (("prefill", 50053), ("decode", 50054)):
        h = svcs[f"pdserve-{role}-pods"]["spec"]
        assert h["clusterIP"] == "None" and h["selector"] == labels(role)
        assert {"name": "grpc", "port": port, "targetPort": "grpc"} in h["ports"]
    assert pod(objs, "decode").ports["mooncake"] == 15000
    decode_args = containers(by_kind(objs, "Deployment")["pdserve-decode"])[0]["args"]
    assert decode_args[decode_args.index("--transfer-port") + 1] == "15000"
    gw_args = containers(by_kind(objs, "Deployment")["pdserve-gateway"])[0]["args"]
    pairs = list(zip(gw_args, gw_args[1:]))
    assert ("--prefill-discovery", "dns:pdserve-prefill-pods:50053") in pairs
    assert ("--decode-discovery", "dns:pdserve-decode-pods:50054") in pairs
    assert "--prefill" not in gw_args and "--decode" not in gw_args, "a ClusterIP Service pins one pod per channel"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_cover_the_serving_roles(overlay):
    pdbs = by_kind(render(overlay), "PodDisruptionBudget")
    for role in ("gateway", "prefill", "decode"):
        spec = pdbs[f"pdserve-{role}"]["spec"]
        assert selects(spec["selector"], labels(role)) and spec["maxUnavailable"] == 1
        assert not any(selects(spec["selector"], labels(r)) for r in ROLES if r != role)
    assert not any(selects(p["spec"]["selector"], labels("broker")) for p in pdbs.values())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_two_gateways_spread_over_nodes_so_a_drain_or_a_node_leaves_one(overlay):
    """One gateway with a PDB of maxUnavailable 1 made every node drain an outage (issue 21)."""
    objs = render(overlay)
    gw = by_kind(objs, "Deployment")["pdserve-gateway"]
    assert gw["spec"]["replicas"] == 2 > by_kind(objs, "PodDisruptionBudget")["pdserve-gateway"]["spec"]["maxUnavailable"]
    spread = {c["topologyKey"]: c for c in gw["spec"]["template"]["spec"]["topologySpreadConstraints"]}
    node = spread["kubernetes.io/hostname"]
    # hard on nodes, but a cordoned (tainted) node is no domain: a drain can always place the replacement
    assert (node["maxSkew"], node["whenUnsatisfiable"], node["nodeTaintsPolicy"]) == (1, "DoNotSchedule", "Honor")
    # soft on zones: nodes without a zone label still take gateways
    assert spread["topology.kubernetes.io/zone"]["whenUnsatisfiable"] == "ScheduleAnyway"
    for c in spread.values():
        assert selects(c["labelSelector"], labels("gateway"))
        assert not any(selects(c["labelSelector"], labels(r)) for r in ROLES if r != "gateway")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_admit_exactly_the_documented_paths(overlay):
    objs = render(overlay)
    pols = list(by_kind(objs, "NetworkPolicy").values())
    pods = {r: pod(objs, r) for r in ROLES}
    outsider = Pod({"app": "anything"}, namespace="elsewhere")
    monitoring = Pod({"app.kubernetes.io/name": "prometheus"}, namespace="monitoring")
    expect = {  # (source, destination, port): allowed
        ("prefill", "broker", 50052): True, ("decode", "broker", 50052): True,
        ("gateway", "broker", 50052): False, ("outsider", "broker", 50052): False,
        ("gateway", "decode", 50054): True, ("prefill", "decode", 50054): False,
        ("prefill", "decode", 15000): True, ("gateway", "decode", 15000): False,
        ("prefill", "decode", 15001): True, ("gateway", "decode", 15001): False, ("prefill", "decode", 15002): False,
        ("outsider", "decode", 15000): False,
        ("gateway", "prefill", 50053): True, ("decode", "prefill", 50053): False,
        ("outsider", "gateway", 50051): True, ("outsider", "gateway", 8000): True,
        ("outsider", "gateway", 9101): False, ("gateway", "broker", 9999): False,
    }
    for role, port in (("gateway", 9101), ("broker", 9102), ("prefill", 9103), ("decode", 9104)):
        expect[("monitoring", role, port)] = True
        expect[("outsider", role, port)] = False
    sources = {**pods, "outsider": outsider, "monitoring": monitoring}
    got = {k: allowed(pols, sources[k[0]], pods[k[1]], k[2]) for k in expect}
    assert got == expect


def test_the_guide_s_patch_admits_only_the_ingress_controller_to_the_gateway(tmp_path):
    """docs/kubernetes.md, 7: the gateway's public ports narrowed to one namespace, in an overlay of the user's own;
    no other policy changes."""
    with open(os.path.join(ROOT, "docs", "kubernetes.md")) as f:
        blocks = [b for b in re.findall(r"```yaml\n(.*?)```", f.read(), re.S) if "name: pdserve-gateway" in b]
    assert len(blocks) == 1, blocks
    cpu = os.path.relpath(os.path.join(K8S, "overlays", "cpu"), tmp_path)
    (tmp_path / "kustomization.yaml").write_text(f"resources: [{cpu}]\n{blocks[0]}")
    objs = kustomize(str(tmp_path))
    pols, gw = list(by_kind(objs, "NetworkPolicy").values()), pod(objs, "gateway")
    ingress = Pod({"app.kubernetes.io/name": "ingress-nginx"}, namespace="ingress-nginx")
    outsider = Pod({"app.kubernetes.io/name": "ingress-nginx"}, namespace="elsewhere")
    for port in (50051, 8000):
        assert allowed(pols, ingress, gw, port) and not allowed(pols, outsider, gw, port), port
    assert not allowed(pols, ingress, gw, 9101)
    plain = by_kind(render("cpu"), "NetworkPolicy")
    assert {n: p for n, p in by_kind(objs, "NetworkPolicy").items() if n != "pdserve-gateway"} == \
        {n: p for n, p in plain.items() if n != "pdserve-gateway"}


def test_cpu_overlay_makes_the_model_in_an_init_container():
    objs = render("cpu")
    assert by_kind(objs, "PersistentVolumeClaim") == {}
    for role in ("prefill", "decode", "gateway"):
        d = by_kind(objs, "Deployment")[f"pdserve-{role}"]
        init = containers(d, init=True)
        assert [c["args"] for c in init] == [["make-model", "--out", "/models/pdserve-tiny", "--preset", "tiny",
                                             "--seed", "0"]]
        assert {"name": "models", "mountPath": "/models"} in init[0]["volumeMounts"]
        vols = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
        assert vols["models"] == {"name": "models", "emptyDir": {}}
        args = containers(d)[0]["args"]
        assert args[args.index("--model") + 1] == "/models/pdserve-tiny"


def test_gpu_overlay_uses_a_read_only_claim_bf16_and_gpu_nodes():
    objs = render("gpu")
    pvc = by_kind(objs, "PersistentVolumeClaim")["pdserve-models"]["spec"]
    assert pvc["accessModes"] == ["ReadOnlyMany"]
    for role in ("prefill", "decode", "gateway"):
        d = by_kind(objs, "Deployment")[f"pdserve-{role}"]
        spec = d["spec"]["template"]["spec"]
        # prefill and decode check their flags first (test_gpu_check.py); nothing fills the claim from the pod
        assert [c["name"] for c in containers(d, init=True)] == ([] if role == "gateway" else ["check"])
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["models"] == {"name": "models", "persistentVolumeClaim": {"claimName": "pdserve-models",
                                                                              "readOnly": True}}
        args = containers(d)[0]["args"]  # a hub id, found in the claim's hub cache (test_gpu_check.py)
        assert args[args.index("--model") + 1] == "meta-llama/Llama-3.1-8B-Instruct"
    for role in ("prefill", "decode"):
        spec = by_kind(objs, "Deployment")[f"pdserve-{role}"]["spec"]["template"]["spec"]
        c = spec["containers"][0]
        assert c["args"][c["args"].index("--kv-cache-dtype") + 1] == "bfloat16"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["resources"]["limits"]["memory"] == c["resources"]["requests"]["memory"] == "24Gi"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        assert spec["nodeSelector"]
    gw = by_kind(objs, "Deployment")["pdserve-gateway"]["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in gw["containers"][0]["resources"]["limits"] and "tolerations" not in gw


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor_scrapes_every_role_and_keeps_the_service_label(overlay):
    objs = render(overlay)
    sm = by_kind(objs, "ServiceMonitor")["pdserve"]["spec"]
    assert sm["endpoints"][0]["port"] == "metrics" and sm["endpoints"][0]["honorLabels"] is True
    assert sm["jobLabel"] == "app.kubernetes.io/name"
    scraped = {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in by_kind(objs, "Service").values()
               if selects(sm["selector"], s["metadata"]["labels"])
               and any(p["name"] == "metrics" for p in s["spec"]["ports"])}
    assert scraped == set(ROLES)


def test_release_label_is_set_per_overlay_and_configurable(tmp_path):
    for overlay in OVERLAYS:
        for kind in ("ServiceMonitor", "PrometheusRule"):
            assert by_kind(render(overlay), kind)["pdserve"]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (tmp_path / "kustomization.yaml").write_text(textwrap.dedent(f"""\
        resources: [{os.path.relpath(os.path.join(K8S, "overlays", "cpu"), tmp_path)}]
        patches:
          - target: {{group: monitoring.coreos.com}}
            patch: |-
              - {{op: replace, path: /metadata/labels/release, value: prom-prod}}
        """))
    objs = kustomize(str(tmp_path))
    for kind in ("ServiceMonitor", "PrometheusRule"):
        assert by_kind(objs, kind)["pdserve"]["metadata"]["labels"]["release"] == "prom-prod"
    assert len(workloads(objs)) == 4
