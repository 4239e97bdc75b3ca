"""Local etcd servers as child processes: one member, or a cluster of members on localhost ports.

Each member runs in its own process group with its data directory under a folder the caller owns, and is
stopped with SIGTERM (SIGKILL after a grace). Should the process that started them die without stopping them
(a test killed by SIGKILL), the kernel SIGKILLs them too (PR_SET_PDEATHSIG, set by util-linux's `setpriv`
before it execs etcd: a Python preexec_fn would run gRPC's after-fork hooks in the child, which abort there when
the fork comes from another thread than the main one). That signal follows the *thread* that forked, so every
member is forked by one thread of the cluster's own that lives as long as the process (a member restarted from a
short-lived worker thread would die with that thread).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

BINARY = "/usr/bin/etcd"
DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "KILL"]


def _free_ports(n: int) -> list[int]:
    # bound together so that the n ports differ; another process may still take one before etcd binds it,
    # which start() reports as a member that never turned healthy
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(slots=True)
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen | None = field(default=None, repr=False)
    tls: tuple[str, str, str] | None = None  # (cert, key, ca): its client port demands a client certificate

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def is_healthy(self, timeout: float = 0.5) -> bool:
        context = None
        if self.tls:
            context = ssl.create_default_context(cafile=self.tls[2])
            context.load_cert_chain(self.tls[0], self.tls[1])
        try:
            with urllib.request.urlopen(f"{'https' if self.tls else 'http'}://{self.endpoint}/health",
                                        timeout=timeout, context=context) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def signal(self, sig: int) -> None:
        if self.is_running():
            os.killpg(self.proc.pid, sig)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; waits for the process either way."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGCONT)  # a stopped member cannot act on SIGTERM
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                self.proc.wait()


class EtcdCluster:
    """`size` members on 127.0.0.1 under `root`; `with EtcdCluster(root, 3) as c:` starts and stops them."""

    def __init__(self, root: Path, size: int = 1, binary: str = BINARY, token: str = "pdserve-etcd",
                 tls: tuple[str, str, str] | None = None) -> None:
        """tls: (cert, key, ca) PEM files: clients must present a certificate the CA signed (mutual TLS); the
        certificate must name 127.0.0.1. Peers talk plaintext on localhost either way."""
        if size < 1:
            raise ValueError(f"an etcd cluster needs at least one member, got {size}")
        if shutil.which(binary) is None:
            raise FileNotFoundError(f"no etcd at {binary}: install Debian's etcd-server (deploy/install.sh apt dev)")
        self.binary = binary
        self.token = token
        self.tls = tls
        ports = _free_ports(2 * size)
        self.members = [EtcdMember(f"m{i}", ports[2 * i], ports[2 * i + 1], Path(root) / f"m{i}.etcd",
                                   Path(root) / f"m{i}.log", tls=tls) for i in range(size)]
        self._forker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="etcd-forker")

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def _argv(self, m: EtcdMember) -> list[str]:
        initial = ",".join(f"{x.name}={x.peer_url}" for x in self.members)
        scheme = "https" if self.tls else "http"
        secure = ["--cert-file", self.tls[0], "--key-file", self.tls[1], "--client-cert-auth",
                  "--trusted-ca-file", self.tls[2]] if self.tls else []
        return [self.binary, "--name", m.name, "--data-dir", str(m.data_dir), *secure,
                "--listen-client-urls", f"{scheme}://{m.endpoint}", "--advertise-client-urls", f"{scheme}://{m.endpoint}",
                "--listen-peer-urls", m.peer_url, "--initial-advertise-peer-urls", m.peer_url,
                "--initial-cluster", initial, "--initial-cluster-token", self.token,
                "--initial-cluster-state", "new", "--log-level", "warn", "--logger", "zap"]

    def _spawn(self, m: EtcdMember) -> None:
        self._forker.submit(self._fork, m).result()

    def _fork(self, m: EtcdMember) -> None:
        m.data_dir.mkdir(parents=True, exist_ok=True)
        with open(m.log_path, "ab") as out:
            m.proc = subprocess.Popen([*DIE_WITH_PARENT, *self._argv(m)], stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)

    def restart(self, m: EtcdMember) -> None:
        """Start a member that was stopped or killed again, on its data (etcd then ignores --initial-cluster)."""
        if m.is_running():
            raise RuntimeError(f"etcd member {m.name} is running")
        self._spawn(m)

    def start(self, timeout: float = 20.0) -> None:
        """Start every member and wait until each reports healthy (a quorum exists and it has a leader)."""
        for m in self.members:
            self._spawn(m)
        deadline = time.monotonic() + timeout
        for m in self.members:
            while not m.is_healthy():
                if not m.is_running() or time.monotonic() > deadline:
                    tail = m.log_path.read_text(errors="replace")[-2000:]
                    self.stop()
                    raise RuntimeError(f"etcd member {m.name} ({m.endpoint}) not healthy after {timeout:.0f} s "
                                       f"(exit {m.proc.poll()}); its log ends:\n{tail}")
                time.sleep(0.05)

    def stop(self) -> None:
        # one by one: a leader that is SIGTERMed hands its leadership over first, which waits out its timeout
        # when every other member is stopping at the same moment
        for m in self.members:
            m.stop()

    def __enter__(self) -> EtcdCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
