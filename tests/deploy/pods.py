"""Runs a rendered Deployment's pod as local processes, taking everything from the manifest: the init
containers' and the container's command, args and env, its ports, volumes and probes. What a kubelet and a
cluster would supply is mapped onto this machine: Service DNS names (in HOST:PORT) and the pod IP become
127.0.0.1, each volume mount becomes a folder of the pod's own, and `pdserve` is this checkout's CLI."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from tests.conftest import ROOT

LOOPBACK = "127.0.0.1"


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
    secrets: dict[str, str] = field(default_factory=dict)  # secretName -> folder with its files
    proc: subprocess.Popen | None = None

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
        return {p["name"]: p["containerPort"] for p in self.container["ports"]}

    def volume_dir(self, name: str) -> str:
        vol = next(v for v in self.spec["volumes"] if v["name"] == name)
        if "secret" in vol:
            secret = vol["secret"]["secretName"]
            assert secret in self.secrets, f"{self.name} mounts Secret {secret}, which the test did not provide"
            return self.secrets[secret]
        assert "emptyDir" in vol, f"{self.name}: volume {vol} is neither an emptyDir nor a Secret"
        path = os.path.join(self.root, "volumes", name)
        os.makedirs(path, exist_ok=True)
        return path

    def env(self, container: dict) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PDSERVE_ENABLE_FAULTS", "PDSERVE_FAULTS", "POD_IP")}
        env["PYTHONPATH"] = ROOT
        for e in container.get("env", []):
            if "value" in e:
                env[e["name"]] = e["value"]
            elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
                env[e["name"]] = LOOPBACK
            else:
                raise AssertionError(f"{self.name}: env {e} has a source this test does not model")
        return env

    def argv(self, container: dict, words: list[str]) -> list[str]:
        """A manifest command line as this machine runs it."""
        env = self.env(container)
        mounts = sorted(((m["mountPath"], self.volume_dir(m["name"])) for m in container.get("volumeMounts", [])),
                        key=lambda m: -len(m[0]))
        hosts = re.compile(r"\b(" + "|".join(map(re.escape, sorted(self.service_names, key=len, reverse=True)))
                           + r")(?=:\d+\b)")
        out = []
        for w in words:
            w = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], w)  # the kubelet's $(VAR) expansion
            w = hosts.sub(LOOPBACK, w)
            for path, local in mounts:
                if w == path or w.startswith(path + "/"):
                    w = local + w[len(path):]
                    break
            out.append(w)
        assert out[0] == "pdserve", f"{self.name}: command {out} does not run pdserve"
        return [sys.executable, "-u", "-m", "pdserve.cli", *out[1:]]

    def run_init_containers(self) -> None:
        for c in self.spec.get("initContainers", []):
            cmd = self.argv(c, c["command"] + c.get("args", []))
            out = subprocess.run(cmd, env=self.env(c), capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, f"{self.name} init container {c['name']} failed: {out.stderr[-2000:]}"

    def start(self) -> None:
        c = self.container
        log = open(os.path.join(self.root, "log.txt"), "w")
        self.proc = subprocess.Popen(self.argv(c, c["command"] + c.get("args", [])), env=self.env(c),
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self, tail: int = 3000) -> str:
        with open(os.path.join(self.root, "log.txt")) as f:
            return f.read()[-tail:]

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


def provide_secrets(pods: list[LocalPod], pki_dir: str) -> None:
    """Each pod's TLS Secret from a throwaway CA, for the identity docs/kubernetes.md tells operators to
    issue: CN ROLE/pdserve-ROLE (make_pki adds the SAN pdserve-ROLE)."""
    from pdserve.common.pki import make_pki
    for pod in pods:
        role = pod.name.removeprefix("pdserve-")
        files = make_pki(pki_dir, [f"{role}/{pod.name}"])[f"{role}/{pod.name}"]
        secret = next(v["secret"]["secretName"] for v in pod.spec["volumes"] if "secret" in v)
        folder = os.path.join(pod.root, "secret")
        os.makedirs(folder, exist_ok=True)
        for src, dst in ((files.cert, "tls.crt"), (files.key, "tls.key"), (files.ca, "ca.crt")):
            shutil.copy(src, os.path.join(folder, dst))
        pod.secrets[secret] = folder
