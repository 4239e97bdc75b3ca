"""The CPU overlay, run as the manifests say: every container's command, args, env, ports and probes come
from the rendered YAML (tests/deploy/pods.py maps Service names and the pod IP to 127.0.0.1 and each
volume to a folder). The init containers make the model, the probes pass, and requests through the
gateway's gRPC and HTTP ports pass the teacher-forcing oracle. It uses the manifests' own ports, so it
cannot run beside `make run`: it checks them first and says which one is taken."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import urllib.request

import pytest

from tests.conftest import ROOT
from tests.deploy.pods import LOOPBACK, LocalPod, port_free
from tests.deploy.render import by_kind, render
from tests.integration.helpers import prompt

ORDER = ("broker", "prefill", "decode", "gateway")  # a kubelet starts them at once; order only saves retries


def digest(folder: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def pods(tmp_path_factory):
    objs = render("cpu")
    deployments = by_kind(objs, "Deployment")
    names = list(by_kind(objs, "Service"))
    root = tmp_path_factory.mktemp("pods")
    # the CA behind the Issuer each pod's csi volume names: every pod gets a certificate for its own name
    issuers = {"pdserve-ca": str(root / "ca")}
    pods = {r: LocalPod(deployments[f"pdserve-{r}"], str(root / r), names, issuers=issuers) for r in ORDER}
    busy = [f"{port} ({p.name} {name})" for p in pods.values() for name, port in p.ports().items()
            if not port_free(port)]
    assert not busy, (f"ports the manifests use are taken: {', '.join(busy)}. Stop whatever holds them "
                      "(`make run` / `pdserve up` use the same defaults) and run again.")
    try:
        for r in ORDER:
            pods[r].run_init_containers()
            pods[r].start()
            pods[r].startup_s = pods[r].wait_started()
        yield pods
    finally:
        for r in reversed(ORDER):
            pods[r].exit_s = pods[r].stop()


def test_init_containers_give_every_pod_the_same_model(pods):
    made = {r: os.path.join(p.volume_dir("models"), "pdserve-tiny") for r, p in pods.items()
            if p.spec.get("initContainers")}
    assert set(made) == {"prefill", "decode", "gateway"}
    digests = {r: digest(d) for r, d in made.items()}
    assert "model.safetensors" in digests["decode"] and "tokenizer.json" in digests["decode"]
    assert digests["prefill"] == digests["decode"] == digests["gateway"]
    with open(os.path.join(ROOT, "models", "pdserve-tiny", "model.safetensors"), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == digests["decode"]["model.safetensors"]


def test_every_probe_passes_once_started(pods):
    for p in pods.values():
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            out = p.probe(kind)
            assert out.returncode == 0 and out.stdout.strip() == "SERVING", (p.name, kind, out.stdout, out.stderr)


def test_each_pod_serves_as_the_identity_its_csi_volume_names(pods):
    """CN ROLE/<pod name>, from the certificate the pod's csi volume asked for: its pools and writer ids are its own."""
    for r, p in pods.items():
        assert f"mutual TLS as {r}/{p.pod_name}" in p.log(tail=1 << 30), p.log()


def test_grpc_requests_through_the_gateway_pass_the_oracle(pods, oracle):
    port = pods["gateway"].ports()["grpc"]
    for n, seed in ((1, 1), (17, 2), (60, 3)):
        p = prompt(n, 1000 + seed)
        out = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--json", "--ignore-eos",
                              "--max-tokens", "6", "--gateway", f"{LOOPBACK}:{port}",
                              "--prompt-token-ids", ",".join(map(str, p))],
                             env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        ids = json.loads(out.stdout)["token_ids"]
        assert len(ids) == 6
        oracle.check(p, ids)


def test_http_requests_on_port_8000_pass_the_oracle(pods, oracle):
    port = pods["gateway"].ports()["http"]
    assert port == 8000
    p = prompt(33, 1100)
    body = json.dumps({"prompt": p, "max_tokens": 5, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://{LOOPBACK}:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out = json.loads(r.read())
    ids = out["choices"][0]["token_ids"]
    assert len(ids) == 5
    oracle.check(p, ids)


def test_metrics_ports_from_the_manifests_serve_pdserve_metrics(pods):
    for p in pods.values():
        with urllib.request.urlopen(f"http://{LOOPBACK}:{p.ports()['metrics']}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert "pdserve_unsafe_mode" in text, p.name


def test_every_declared_container_port_listens(pods):
    """A port the manifests declare (Services, NetworkPolicies and the ServiceMonitor use them) that the
    process does not open is a manifest out of step with the code: decode's `mooncake` port included."""
    closed = []
    for p in pods.values():
        for name, port in p.ports().items():
            with socket.socket() as s:
                s.settimeout(5)
                if s.connect_ex((LOOPBACK, port)) != 0:
                    closed.append(f"{p.name} {name} {port}")
    assert closed == []


def test_zz_each_pod_exits_on_sigterm_within_its_grace_period(pods):
    """Last in the file: stops the pods the way the kubelet does, gateway first."""
    for r in reversed(ORDER):
        took = pods[r].stop()
        grace = pods[r].spec["terminationGracePeriodSeconds"]
        assert took is not None, f"{pods[r].name} ignored SIGTERM for its {grace}s grace period:\n{pods[r].log()}"
