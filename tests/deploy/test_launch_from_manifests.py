"""The CPU overlay, run as the manifests say: every container's command, args, env, ports and probes come
from the rendered YAML (tests/deploy/pods.py maps Service names and the pod IP to 127.0.0.1 and each
volume to a folder), and each Deployment runs as many pods as its `replicas` (two gateways). The init containers
make the model, the probes pass, and requests through every gateway's gRPC and HTTP ports pass the teacher-forcing
oracle and are counted by the gateway that served them. The gateways read their API keys from a Secret made as
docs/kubernetes.md says (tests/deploy/api_keys.py), and refuse a call without one. The first pod of each
Deployment uses the manifests' own ports, so it cannot run beside `make run`: it checks them first and says which
one is taken; further replicas listen on free ports of their own, as they would in network namespaces of their
own."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from pdserve.gateway.api_key import REFUSAL
from tests.conftest import ROOT
from tests.deploy.api_keys import make_secret
from tests.deploy.pods import LOOPBACK, LocalPod, give_own_ports, port_free, replica_names
from tests.deploy.render import by_kind, render
from tests.integration.helpers import prompt

ORDER = ("broker", "prefill", "decode", "gateway")  # a kubelet starts them at once; order only saves retries
TENANTS = ("acme", "globex")


def digest(folder: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def api_keys(tmp_path_factory) -> tuple[dict, dict[str, str]]:
    """(the Secret in the namespace, {tenant: key}), made as the operator makes them."""
    return make_secret(str(tmp_path_factory.mktemp("operator")), list(TENANTS))


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, api_keys) -> dict[str, list[LocalPod]]:
    """Every pod of every Deployment, by role: spec.replicas of them, each named as its ReplicaSet would name it."""
    objs = render("cpu")
    deployments = by_kind(objs, "Deployment")
    names = list(by_kind(objs, "Service"))
    root = tmp_path_factory.mktemp("pods")
    # the CA behind the Issuer each pod's csi volume names: every pod gets a certificate for its own name
    issuers = {"pdserve-ca": str(root / "ca")}
    secrets = {api_keys[0]["metadata"]["name"]: api_keys[0]}
    pods: dict[str, list[LocalPod]] = {}
    for r in ORDER:
        d = deployments[f"pdserve-{r}"]
        pods[r] = [LocalPod(d, str(root / f"{r}-{i}"), names, pod_name=name, issuers=issuers, secrets=secrets)
                   for i, name in enumerate(replica_names(d, d["spec"].get("replicas", 1)))]
        for extra in pods[r][1:]:
            give_own_ports(extra)
    busy = [f"{port} ({ps[0].name} {name})" for ps in pods.values() for name, port in ps[0].ports().items()
            if not port_free(port)]
    assert not busy, (f"ports the manifests use are taken: {', '.join(busy)}. Stop whatever holds them "
                      "(`make run` / `pdserve up` use the same defaults) and run again.")
    try:
        for r in ORDER:
            for p in pods[r]:
                p.run_init_containers()
                p.start()
            for p in pods[r]:
                p.startup_s = p.wait_started()
        yield pods
    finally:
        for r in reversed(ORDER):
            for p in pods[r]:
                p.exit_s = p.stop()


@pytest.fixture(scope="module")
def pods(replicas) -> dict[str, LocalPod]:
    """The first pod of each Deployment, on the manifests' own ports."""
    return {r: ps[0] for r, ps in replicas.items()}


def every_pod(replicas) -> list[LocalPod]:
    return [p for ps in replicas.values() for p in ps]


def test_each_deployment_runs_its_replicas_and_the_gateway_two(replicas):
    for r, ps in replicas.items():
        assert len(ps) == ps[0].deployment["spec"].get("replicas", 1) and len({p.pod_name for p in ps}) == len(ps)
    assert len(replicas["gateway"]) == 2 and len(replicas["broker"]) == 1


def test_init_containers_give_every_pod_the_same_model(replicas):
    made = {p.pod_name: os.path.join(p.volume_dir("models"), "pdserve-tiny") for p in every_pod(replicas)
            if p.spec.get("initContainers")}
    assert {name.rsplit("-", 2)[0] for name in made} == {"pdserve-prefill", "pdserve-decode", "pdserve-gateway"}
    assert len(made) == 4  # both gateways make their own
    digests = [digest(d) for d in made.values()]
    assert "model.safetensors" in digests[0] and "tokenizer.json" in digests[0]
    assert all(d == digests[0] for d in digests)
    with open(os.path.join(ROOT, "models", "pdserve-tiny", "model.safetensors"), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == digests[0]["model.safetensors"]


def test_every_probe_passes_once_started(replicas):
    for p in every_pod(replicas):
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            out = p.probe(kind)
            assert out.returncode == 0 and out.stdout.strip() == "SERVING", (p.name, kind, out.stdout, out.stderr)


def test_each_pod_serves_as_the_identity_its_csi_volume_names(replicas):
    """CN ROLE/<pod name>, from the certificate the pod's csi volume asked for: its pools and writer ids are its own."""
    for r, ps in replicas.items():
        for p in ps:
            assert f"mutual TLS as {r}/{p.pod_name}" in p.log(tail=1 << 30), p.log()


def generate(gw: LocalPod, p: list[int], key: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
    return subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--json", "--ignore-eos",
                           "--max-tokens", "6", "--gateway", f"{LOOPBACK}:{gw.port('grpc')}",
                           "--prompt-token-ids", ",".join(map(str, p))],
                          env={**env, "PYTHONPATH": ROOT, **({"PDSERVE_API_KEY": key} if key else {})},
                          capture_output=True, text=True, timeout=120)


def test_grpc_requests_through_every_gateway_pass_the_oracle(replicas, api_keys, oracle):
    keys = api_keys[1]
    for i, gw in enumerate(replicas["gateway"]):
        for n, seed in ((1, 1), (17, 2), (60, 3)):
            p = prompt(n, 1000 + 10 * i + seed)
            out = generate(gw, p, keys[TENANTS[(i + seed) % len(TENANTS)]])
            assert out.returncode == 0, out.stderr
            ids = json.loads(out.stdout)["token_ids"]
            assert len(ids) == 6
            oracle.check(p, ids)


def completion(port: int, body: dict, key: str | None) -> dict:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(f"http://{LOOPBACK}:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **auth})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_every_gateway_reads_the_keys_of_the_secret_and_refuses_a_call_without_one(replicas, api_keys):
    p = prompt(12, 1050)
    for gw in replicas["gateway"]:
        assert f"API keys of {len(TENANTS)} tenant(s) from {gw.volume_dir('api-keys')}/keys" in gw.log(tail=1 << 30)
        for key in (None, "sk-not-in-the-secret-0001"):
            out = generate(gw, p, key)
            assert out.returncode == 2 and json.loads(out.stdout) == {"error": {
                "code": "UNAUTHENTICATED", "reason": "API_KEY", "message": REFUSAL.message}}, \
                (gw.pod_name, key, out.stdout, out.stderr)
            with pytest.raises(urllib.error.HTTPError) as e:
                completion(gw.port("http"), {"prompt": p, "max_tokens": 2}, key)
            assert e.value.code == 401 and json.loads(e.value.read())["error"]["code"] == "invalid_api_key"


def test_http_requests_on_port_8000_pass_the_oracle(pods, api_keys, oracle):
    port = pods["gateway"].ports()["http"]
    assert port == 8000
    p = prompt(33, 1100)
    ids = completion(port, {"prompt": p, "max_tokens": 5, "temperature": 0, "ignore_eos": True},
                     api_keys[1]["acme"])["choices"][0]["token_ids"]
    assert len(ids) == 5
    oracle.check(p, ids)


def test_each_gateway_counts_the_http_requests_and_tokens_it_served(replicas, api_keys, oracle):
    """A request through one gateway moves that gateway's counters by what it implies, and the other's not at all."""
    gateways = replicas["gateway"]
    completions = {"route": "/v1/completions", "status": "200"}
    for i, served in enumerate(gateways):
        before = [(g.metric("pdserve_http_requests_total", completions), g.metric("pdserve_prompt_tokens_total"),
                   g.metric("pdserve_generation_tokens_total")) for g in gateways]
        p = prompt(21, 1200 + i)
        ids = completion(served.port("http"), {"prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
                         api_keys[1][TENANTS[i % len(TENANTS)]])["choices"][0]["token_ids"]
        oracle.check(p, ids)
        after = [(g.metric("pdserve_http_requests_total", completions), g.metric("pdserve_prompt_tokens_total"),
                  g.metric("pdserve_generation_tokens_total")) for g in gateways]
        for j, g in enumerate(gateways):
            moved = tuple(a - b for a, b in zip(after[j], before[j]))
            assert moved == ((1, 21, 4) if j == i else (0, 0, 0)), (g.pod_name, moved)
        with urllib.request.urlopen(f"http://{LOOPBACK}:{served.port('http')}/health", timeout=10) as r:
            assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}


def test_metrics_ports_from_the_manifests_serve_pdserve_metrics(replicas):
    for p in every_pod(replicas):
        with urllib.request.urlopen(f"http://{LOOPBACK}:{p.port('metrics')}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert "pdserve_unsafe_mode" in text, p.name


def test_every_declared_container_port_listens(replicas):
    """A port the manifests declare (Services, NetworkPolicies and the ServiceMonitor use them) that the
    process does not open is a manifest out of step with the code: decode's `mooncake` port included."""
    closed = []
    for p in every_pod(replicas):
        for name in p.ports():
            with socket.socket() as s:
                s.settimeout(5)
                if s.connect_ex((LOOPBACK, p.port(name))) != 0:
                    closed.append(f"{p.pod_name} {name} {p.port(name)}")
    assert closed == []


def test_zz_each_pod_exits_on_sigterm_within_its_grace_period(replicas):
    """Last in the file: stops the pods the way the kubelet does, gateways first."""
    for r in reversed(ORDER):
        for p in replicas[r]:
            took = p.stop()
            grace = p.spec["terminationGracePeriodSeconds"]
            assert took is not None, f"{p.pod_name} ignored SIGTERM for its {grace}s grace period:\n{p.log()}"
