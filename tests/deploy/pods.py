"""Runs a rendered Deployment's pod as local processes, taking everything from the manifest: the init
containers' and the container's command, args and env, its ports, volumes and probes. What a kubelet and a
cluster would supply is mapped onto this machine: Service DNS names (in HOST:PORT) and the pod IP become
127.0.0.1, each volume mount becomes a folder of the pod's own, its cert-manager csi volume a certificate
issued for the pod's own name by a local CA, a Secret volume the files of a Secret object the test made (as
`kubectl create secret` makes it), and `pdserve` is this checkout's CLI.

Two replicas of one Deployment cannot share a port here as they would in two network namespaces: a pod
given `ports_here` listens on those ports instead (give_own_ports picks free ones), the flags that set them
are rewritten or added, and pods that reach it through a Service name find it through `peers`."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field

from tests.conftest import ROOT
from tests.deploy import csi

LOOPBACK = "127.0.0.1"
# the flag that sets each named container port; Mooncake's data port is always --transfer-port + 1
PORT_FLAGS = {"grpc": "--port", "metrics": "--metrics-port", "http": "--http-port", "mooncake": "--transfer-port"}
FOLLOWS = {"mooncake-data": ("mooncake", 1)}
# the characters Kubernetes puts in generated names (pod-template-hash and the pod's own suffix)
_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"


def replica_names(deployment: dict, n: int, seed: int = 0) -> list[str]:
    """Names a ReplicaSet of this Deployment gives n pods: NAME-<template hash>-<5 random>, the hash shared
    (one template), the suffix each pod's own."""
    digest = hashlib.sha256(json.dumps(deployment["spec"]["template"], sort_keys=True).encode()).digest()
    template_hash = "".join(_NAME_CHARS[b % len(_NAME_CHARS)] for b in digest[:10])
    rng = random.Random(seed)
    names: list[str] = []
    while len(names) < n:
        name = f"{deployment['metadata']['name']}-{template_hash}-{''.join(rng.choices(_NAME_CHARS, k=5))}"
        if name not in names:
            names.append(name)
    return names


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@dataclass
class LocalPod:
    """One replica of a Deployment; root holds one folder per volume and the process logs."""
    deployment: dict
    root: str
    service_names: list[str]
    pod_name: str = ""  # metadata.name, ${POD_NAME} of its csi volume; default: the first of replica_names
    issuers: dict[str, str] = field(default_factory=dict)  # cert-manager Issuer name -> folder with ca.crt, ca.key
    secrets: dict[str, dict] = field(default_factory=dict)  # Secret name -> the Secret object in the namespace
    ports_here: dict[int, int] = field(default_factory=dict)  # containerPort -> the port it has on this machine
    peers: dict[str, "LocalPod"] = field(default_factory=dict)  # Service name -> the pod behind it
    namespace: str = "pdserve"
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    proc: subprocess.Popen | None = None

    def __post_init__(self):
        self.pod_name = self.pod_name or replica_names(self.deployment, 1)[0]

    @property
    def name(self) -> str:
        return self.deployment["metadata"]["name"]

    @property
    def spec(self) -> dict:
        return self.deployment["spec"]["template"]["spec"]

    @property
    def container(self) -> dict:
        return self.spec["containers"][0]

    def ports(self) -> dict[str, int]:
        """The container's ports by name, as the manifest declares them."""
        return {p["name"]: p["containerPort"] for p in self.container["ports"]}

    def port(self, name: str) -> int:
        """Where the named port listens on this machine."""
        number = self.ports()[name]
        return self.ports_here.get(number, number)

    def variables(self) -> dict[str, str]:
        return csi.pod_variables(self.pod_name, self.namespace, self.uid,
                                 self.spec.get("serviceAccountName", "default"))

    def volume_dir(self, name: str) -> str:
        vol = next(v for v in self.spec["volumes"] if v["name"] == name)
        path = os.path.join(self.root, "volumes", name)
        if "csi" in vol:
            return self._csi_volume(vol, path)
        if "secret" in vol:
            return self._secret_volume(vol["secret"], path)
        assert "emptyDir" in vol, f"{self.name}: volume {vol} is neither an emptyDir, a Secret nor a cert-manager " \
                                  "csi volume"
        os.makedirs(path, exist_ok=True)
        return path

    def _csi_volume(self, vol: dict, path: str) -> str:
        """What cert-manager's csi-driver mounts: a key and a certificate issued for this pod by the Issuer the
        volume names, and that Issuer's CA. Issued once per pod, as the driver does at the pod's start. Besides
        the names the volume asks for, the certificate carries localhost and 127.0.0.1, the addresses Service
        names become here."""
        if os.path.isdir(path):
            return path
        from pdserve.common.pki import issue
        req = csi.request_for(vol, self.variables())
        group, kind, issuer = req.issuer
        assert (group, kind) == ("cert-manager.io", "Issuer") and issuer in self.issuers, \
            f"{self.name}: volume {vol['name']} asks {kind} {issuer!r}, which the test did not provide"
        files = issue(self.issuers[issuer], req.common_name, req.dns_names)
        os.makedirs(path)
        for src, key in ((files.cert, "cert"), (files.key, "key"), (files.ca, "ca")):
            shutil.copy(src, os.path.join(path, req.files[key]))
            os.chmod(os.path.join(path, req.files[key]), 0o440)
        return path

    def _secret_volume(self, src: dict, path: str) -> str:
        """What the kubelet mounts for a Secret volume: each of `items` (else every key) as a file, with the item's
        mode, else defaultMode, else 0644. A Secret that is not there (unless the volume is optional) or a key it
        lacks stops the pod, as either holds a real one in ContainerCreating."""
        if os.path.isdir(path):
            return path
        secret = self.secrets.get(src["secretName"])
        if secret is None:
            assert src.get("optional"), f"{self.name}: no Secret {src['secretName']}; the pod would not start"
            os.makedirs(path)
            return path
        data = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
        data.update({k: v.encode() for k, v in (secret.get("stringData") or {}).items()})
        items = src.get("items") or [{"key": k, "path": k} for k in data]
        missing = [i["key"] for i in items if i["key"] not in data]
        assert not missing, f"{self.name}: Secret {src['secretName']} has no key {missing} (it has {sorted(data)})"
        os.makedirs(path)
        for i in items:
            file = os.path.join(path, i["path"])
            os.makedirs(os.path.dirname(file), exist_ok=True)
            with open(file, "wb") as f:
                f.write(data[i["key"]])
            os.chmod(file, i.get("mode", src.get("defaultMode", 0o644)))
        return path

    def env(self, container: dict) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PDSERVE_ENABLE_FAULTS", "PDSERVE_FAULTS", "POD_IP")}
        # the caller's own entries stay behind it: a checkout whose pdserve is found through PYTHONPATH
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
        for e in container.get("env", []):
            if "value" in e:
                env[e["name"]] = e["value"]
            elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
                env[e["name"]] = LOOPBACK
            else:
                raise AssertionError(f"{self.name}: env {e} has a source this test does not model")
        return env

    def _service_address(self, m: re.Match) -> str:
        peer, port = self.peers.get(m.group(1)), int(m.group(2))
        # every Service here exposes a container port under its own number
        return f"{LOOPBACK}:{peer.ports_here.get(port, port) if peer else port}"

    def _own_ports(self, words: list[str], serve: bool) -> list[str]:
        """The flags that set a declared port, moved to ports_here; the service's own command also gets the
        flags it left at their defaults."""
        out, flags = list(words), set(PORT_FLAGS.values())
        for i in range(1, len(out)):
            if out[i - 1] in flags and out[i].isdigit() and int(out[i]) in self.ports_here:
                out[i] = str(self.ports_here[int(out[i])])
        if serve:
            declared = self.ports()
            out += [x for name, flag in PORT_FLAGS.items() if name in declared and flag not in out
                    for x in (flag, str(self.port(name)))]
        return out

    def argv(self, container: dict, words: list[str], serve: bool = False) -> list[str]:
        """A manifest command line as this machine runs it (serve: the service's own command)."""
        env = self.env(container)
        mounts = sorted(((m["mountPath"], self.volume_dir(m["name"])) for m in container.get("volumeMounts", [])),
                        key=lambda m: -len(m[0]))
        hosts = re.compile(r"\b(" + "|".join(map(re.escape, sorted(self.service_names, key=len, reverse=True)))
                           + r"):(\d+)\b")
        out = []
        for w in words:
            w = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], w)  # the kubelet's $(VAR) expansion
            w = hosts.sub(self._service_address, w)
            for path, local in mounts:
                if w == path or w.startswith(path + "/"):
                    w = local + w[len(path):]
                    break
            out.append(w)
        assert out[0] == "pdserve", f"{self.name}: command {out} does not run pdserve"
        if self.ports_here:
            out = self._own_ports(out, serve)
        return [sys.executable, "-u", "-m", "pdserve.cli", *out[1:]]

    def run_init_containers(self) -> None:
        for c in self.spec.get("initContainers", []):
            cmd = self.argv(c, c["command"] + c.get("args", []))
            out = subprocess.run(cmd, env=self.env(c), capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, f"{self.name} init container {c['name']} failed: {out.stderr[-2000:]}"

    def start(self) -> None:
        c = self.container
        os.makedirs(self.root, exist_ok=True)
        log = open(os.path.join(self.root, "log.txt"), "w")
        self.proc = subprocess.Popen(self.argv(c, c["command"] + c.get("args", []), serve=True), env=self.env(c),
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self, tail: int = 3000) -> str:
        with open(os.path.join(self.root, "log.txt")) as f:
            return f.read()[-tail:]

    def metric(self, name: str, labels: dict | None = None) -> float:
        """The sum of the series of one metric that carry these labels, from the pod's metrics port; KeyError
        when there is none (a counter must exist from start-up)."""
        with urllib.request.urlopen(f"http://{LOOPBACK}:{self.port('metrics')}/metrics", timeout=10) as r:
            text = r.read().decode()
        want = [f'{k}="{v}"' for k, v in (labels or {}).items()]
        values = [float(m.group(3)) for m in re.finditer(r"^(\w+)(?:\{(.*)\})? (\S+)$", text, re.M)
                  if m.group(1) == name and all(w in (m.group(2) or "").split(",") for w in want)]
        if not values:
            raise KeyError(f"{self.pod_name} exports no {name} with {labels}")
        return sum(values)

    def probe(self, kind: str) -> subprocess.CompletedProcess:
        p = self.container[kind]
        return subprocess.run(self.argv(self.container, p["exec"]["command"]), env=self.env(self.container),
                              capture_output=True, text=True, timeout=p.get("timeoutSeconds", 1) + 30)

    def wait_started(self) -> float:
        """Polls the startupProbe within the manifest's budget (periodSeconds x failureThreshold), at most
        every second: the seconds it took."""
        p = self.container["startupProbe"]
        budget = p.get("periodSeconds", 10) * p.get("failureThreshold", 3)
        t0 = time.monotonic()
        while True:
            out = self.probe("startupProbe")
            if out.returncode == 0:
                return time.monotonic() - t0
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode} before its startupProbe "
                                     f"passed:\n{self.log()}")
            if time.monotonic() - t0 > budget:
                raise AssertionError(f"{self.name}: startupProbe still failing after its {budget}s budget: "
                                     f"{out.stdout}{out.stderr}\n{self.log()}")
            time.sleep(1)

    def stop(self) -> float | None:
        """SIGTERM as the kubelet sends it after preStop; SIGKILL after terminationGracePeriodSeconds. The
        seconds it took to exit, or None if it had to be killed."""
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        grace = self.spec.get("terminationGracePeriodSeconds", 30)
        t0 = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace)
            return time.monotonic() - t0
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            return None


_HANDED_OUT: set[int] = set()


def _unused_port(n: int) -> int:
    """The first of n consecutive ports free on every address, below the kernel's ephemeral range and never handed
    out before in this process. A port the kernel picks for bind(0) comes from that range, so between its release
    and the pod's own bind an outgoing connection of a test running beside this one, or the next bind(0) here (two
    pods of one test), could take it: the pod then exits "Address already in use"."""
    rng = random.Random()
    for _ in range(1000):
        base = rng.randrange(20000, 32000 - n)
        span = range(base, base + n)
        if not _HANDED_OUT.intersection(span) and all(port_free(p) for p in span):
            _HANDED_OUT.update(span)
            return base
    raise RuntimeError(f"no {n} consecutive free ports in 20000-32000 after 1000 tries")


def give_own_ports(pod: LocalPod) -> None:
    """Free ports on this machine for each of the pod's declared ports, as its own network namespace would
    have them; Mooncake's pair consecutive and below the kernel's ephemeral range, as --transfer-port needs."""
    declared = pod.ports()
    for name, number in declared.items():
        if name in FOLLOWS or name == "mooncake":
            continue
        pod.ports_here[number] = _unused_port(1)
    if "mooncake" in declared:
        pod.ports_here[declared["mooncake"]] = _unused_port(2)
    for name, (after, offset) in FOLLOWS.items():
        if name in declared:
            pod.ports_here[declared[name]] = pod.ports_here[declared[after]] + offset
