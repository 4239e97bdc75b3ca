"""Starts services as child processes and waits until each reports ready (used by `pdserve up` and tests)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from .common import lifeline

HTTP_READY = re.compile(r"PDSERVE_HTTP port=(\d+)")
READY = re.compile(r"PDSERVE_READY service=(\w+) port=(\d+) metrics_port=(\d+)")
OPERATOR = "operator/local"  # the identity `pdserve up` and the tests use to call services directly


# test-only switches (services/common/faults.py): a child gets them only when the caller names them in `env`, so
# `pdserve up` run from a shell that happens to export them does not arm fault points
TEST_ONLY_ENV = ("PDSERVE_ENABLE_FAULTS", "PDSERVE_FAULTS")


def child_env(env: dict | None, parent: dict | None = None) -> dict:
    """The parent's environment without the test-only switches, then `env` on top."""
    parent = os.environ if parent is None else parent
    return {**{k: v for k, v in parent.items() if k not in TEST_ONLY_ENV}, **(env or {})}


@dataclass(eq=False)
class Proc:
    name: str
    args: list[str]
    popen: subprocess.Popen
    port: int = 0
    metrics_port: int = 0
    http_port: int = 0
    lines: list[str] = field(default_factory=list)
    lifeline_fd: int = -1  # the write end of the child's lifeline: only this process holds it
    ready: threading.Event = field(default_factory=threading.Event)  # set at its ready line, or when it exits

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None


def start(name: str, args: list[str], env: dict | None = None, timeout: float = 120.0, echo: bool = False,
          log_path: str | None = None) -> Proc:
    """Runs `pdserve <args>` and returns once it prints its ready line; raises with its output otherwise."""
    return wait_ready(launch(name, args, env, echo, log_path), timeout)


def launch(name: str, args: list[str], env: dict | None = None, echo: bool = False,
           log_path: str | None = None) -> Proc:
    """Runs `pdserve <args>` without waiting for it (wait_ready does): services that do not depend on each
    other load their models side by side."""
    cmd = [sys.executable, "-u", "-m", "pdserve.cli", *args]
    # the child stops when this process dies, even by SIGKILL (services/common/lifeline.py); its own session
    # keeps a terminal's Ctrl-C from reaching it before `pdserve up` stops it in order
    read_end, write_end = lifeline.parent_end()
    try:
        popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env={**child_env(env), lifeline.ENV: str(read_end)}, start_new_session=True,
                                 pass_fds=(read_end,))
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    proc = Proc(name, args, popen, lifeline_fd=write_end)
    ready = proc.ready
    sink = open(log_path, "a") if log_path else None

    def pump():
        for line in popen.stdout:
            proc.lines.append(line)
            del proc.lines[:-400]
            if sink:
                sink.write(line)
                sink.flush()
            if echo:
                sys.stdout.write(f"[{name}] {line}")
            h = HTTP_READY.search(line)
            if h:
                proc.http_port = int(h.group(1))
            m = READY.search(line)
            if m and not ready.is_set():
                proc.port, proc.metrics_port = int(m.group(2)), int(m.group(3))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    return proc


class StartFailed(RuntimeError):
    """A service that exited or hung before its ready line; `last_line` is its own last word (a refusal's reason)."""

    def __init__(self, message: str, proc: Proc):
        super().__init__(message)
        self.proc = proc
        self.last_line = next((line.strip() for line in reversed(proc.lines) if line.strip()), "")


def wait_ready(proc: Proc, timeout: float = 120.0) -> Proc:
    name, popen = proc.name, proc.popen
    deadline = time.monotonic() + timeout
    while not proc.ready.wait(0.1):
        if time.monotonic() > deadline:
            stop(proc)
            raise StartFailed(f"{name} not ready after {timeout:.0f}s:\n{''.join(proc.lines[-40:])}", proc)
    if not proc.port:
        popen.wait(5)
        stop(proc)  # closes its lifeline
        raise StartFailed(f"{name} exited with {popen.returncode} before it was ready:\n{''.join(proc.lines[-40:])}",
                          proc)
    return proc


def restart(proc: Proc, env: dict | None = None, echo: bool = False, timeout: float = 120.0,
            log_path: str | None = None) -> Proc:
    """Starts a service that exited (or is stopped here) again, with its arguments, on the ports it had (its clients
    know them)."""
    stop(proc)  # closes its lifeline
    args = list(proc.args)
    for flag, value in (("--port", proc.port), ("--metrics-port", proc.metrics_port)):
        if flag in args:
            args[args.index(flag) + 1] = str(value)
    return start(proc.name, args, env, timeout, echo, log_path)


def terminate(proc: Proc) -> None:
    """SIGTERM to the service's process group (it drains and exits); stop() waits for it."""
    if proc.alive():
        try:
            os.killpg(proc.popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def stop(proc: Proc, timeout: float = 10.0) -> int | None:
    if proc.alive():
        terminate(proc)
        try:
            proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait(5)
    if proc.lifeline_fd >= 0 and not proc.alive():
        os.close(proc.lifeline_fd)
        proc.lifeline_fd = -1
    return proc.popen.returncode


def start_stack(model: str, *, base_ports: bool = False, context_length: int = 0, page_size: int = 16,
                prefill_pool_tokens: int = 8192, decode_pool_tokens: int = 32768, allow_small: bool = False,
                num_prefill: int = 1, num_decode: int = 1, env: dict | None = None, echo: bool = False,
                log_dir: str | None = None, extra: dict | None = None, tls_dir: str | None = None,
                insecure: bool = False, devices: dict[str, list[str]] | None = None,
                gateway_env: dict | None = None, brokers: int = 1, etcd: str = "") -> dict[str, list[Proc]]:
    """Broker, prefills, decodes, gateway. base_ports=True uses the default ports (pdserve up); otherwise
    every port is 0 (picked by the OS), as tests need. Mutual TLS by default: a throwaway CA and one
    certificate per service (plus OPERATOR) go to tls_dir, else log_dir/tls, else a new temporary folder;
    insecure=True passes --insecure instead (loud, unsafe). devices: per role ("prefill", "decode"), the --device
    of each instance in order. gateway_env: variables for the gateway alone (its API key). brokers > 1: that many
    broker replicas electing a leader on the etcd endpoints `etcd`; prefill and decode get all their addresses."""
    from .common import config

    def ports(name: str, i: int) -> list[str]:
        if not base_ports:
            return ["--port", "0", "--metrics-port", "0"] + (["--http-port", "0"] if name == "gateway" else [])
        base = {"gateway": config.GATEWAY_PORT, "broker": config.BROKER_PORT, "prefill": config.PREFILL_PORT,
                "decode": config.DECODE_PORT}[name]
        return ["--port", str(base + 100 * i), "--metrics-port", str(config.METRICS_PORTS[name] + 10 * i)]

    def log(name):
        return os.path.join(log_dir, f"{name}.log") if log_dir else None

    extra = extra or {}
    for role, count in (("prefill", num_prefill), ("decode", num_decode)):
        if (devices or {}).get(role) and len(devices[role]) != count:
            raise ValueError(f"{len(devices[role])} {role} devices for {count} {role} instances")
    tls_dir = None if insecure else (tls_dir or (os.path.join(log_dir, "tls") if log_dir
                                                 else tempfile.mkdtemp(prefix="pdserve-tls-")))

    if tls_dir is not None:
        from .common.pki import make_pki
        make_pki(tls_dir, [OPERATOR])

    def tls(role: str, i: int) -> list[str]:
        if tls_dir is None:
            return ["--insecure", "--allow-unsafe", "insecure"]
        f = make_pki(tls_dir, [f"{role}/{role}{i}"])[f"{role}/{role}{i}"]
        return ["--tls-cert", f.cert, "--tls-key", f.key, "--tls-ca", f.ca]
    common = ["--model", model, "--page-size", str(page_size)]

    def device(role: str, i: int) -> list[str]:
        named = (devices or {}).get(role) or []
        return ["--device", named[i]] if named else []

    def pool(tokens: int) -> list[str]:  # 0: the extra flags size the pool (--kv-cache-memory, a fraction)
        return ["--pool-tokens", str(tokens)] if tokens else []
    if context_length:
        common += ["--context-length", str(context_length)]
    if allow_small:
        common += ["--allow-pool-smaller-than-context"]
    procs: dict[str, list[Proc]] = {"broker": [], "prefill": [], "decode": [], "gateway": []}
    try:
        if brokers > 1 and not etcd:
            raise ValueError(f"{brokers} broker replicas need etcd endpoints to elect a leader on")
        elect = ["--etcd", etcd] if brokers > 1 else []
        for i in range(brokers):
            name = "broker" if i == 0 else f"broker{i}"
            procs["broker"].append(launch(name, ["broker", *ports("broker", i), *tls("broker", i), *elect,
                                                 *extra.get("broker", [])], env, echo=echo, log_path=log(name)))
        for p in procs["broker"]:
            wait_ready(p)
        broker_targets = ",".join(p.target for p in procs["broker"])
        for i in range(num_prefill):
            procs["prefill"].append(launch(f"prefill{i}", ["prefill", *ports("prefill", i), *tls("prefill", i),
                                                          "--broker", broker_targets, *device("prefill", i),
                                                          *common, *pool(prefill_pool_tokens),
                                                          *extra.get("prefill", [])], env, echo=echo,
                                           log_path=log(f"prefill{i}")))
        for i in range(num_decode):
            procs["decode"].append(launch(f"decode{i}", ["decode", *ports("decode", i), *tls("decode", i),
                                                        "--broker", broker_targets, *device("decode", i),
                                                        *common, *pool(decode_pool_tokens),
                                                        *extra.get("decode", [])], env, echo=echo,
                                          log_path=log(f"decode{i}")))
        for p in [*procs["prefill"], *procs["decode"]]:  # they depend on the broker only: loaded side by side
            wait_ready(p)
        gw = ["gateway", *ports("gateway", 0), *tls("gateway", 0), "--model", model,
              *(["--context-length", str(context_length)] if context_length else []), *extra.get("gateway", [])]
        for p in procs["prefill"]:
            gw += ["--prefill", p.target]
        for p in procs["decode"]:
            gw += ["--decode", p.target]
        procs["gateway"].append(start("gateway", gw, {**(env or {}), **(gateway_env or {})}, echo=echo,
                                      log_path=log("gateway")))
    except BaseException:
        stop_stack(procs)
        raise
    return procs


def stop_stack(procs: dict[str, list[Proc]]) -> None:
    """Tier by tier (gateway, decodes, prefills, broker); the instances of one tier drain side by side."""
    for name in ("gateway", "decode", "prefill", "broker"):
        tier = procs.get(name, [])
        for p in tier:
            terminate(p)
        for p in tier:
            stop(p)
