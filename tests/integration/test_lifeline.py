"""`pdserve up` SIGKILLed while serving leaves nothing behind (issue 10): its services notice through their
lifeline (services/common/lifeline.py) and stop, and every port they held can be bound again."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from pdserve.launcher import HTTP_READY, READY
from tests.integration.helpers import prompt
from tests.integration.procnet import listeners

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GONE_WITHIN_S = 20.0  # the lifeline's graceful stop plus its hard exit (5 s), on a loaded machine


def children(pid: int) -> dict[int, str]:
    """pid -> command line of every live process whose parent is pid."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out[int(entry)] = cmd
    return out


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper (whoever inherited it may not reap at once)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def bindable(port: int) -> bool:
    """Whether a server could listen on port again; SO_REUSEADDR, as servers set it, so that connections the
    services closed (TIME_WAIT) do not count, while a socket still listening does."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


def complete(http_port: int, ids: list[int]) -> list[int]:
    body = json.dumps({"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def test_sigkilled_up_leaves_no_service_and_frees_its_ports(model_dir, oracle, tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    up = subprocess.Popen([sys.executable, "-u", "-m", "pdserve.cli", "up", "--model", model_dir, "--free-ports",
                           "--tls-dir", str(tmp_path / "tls")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
    services: dict[int, str] = {}
    try:
        ports, http_port, seen = [], 0, []
        deadline = time.monotonic() + 300
        for line in up.stdout:
            seen.append(line)
            if m := READY.search(line):
                ports += [int(m.group(2)), int(m.group(3))]
            if h := HTTP_READY.search(line):
                http_port = int(h.group(1))
            if line.startswith("pdserve is up") or time.monotonic() > deadline:
                break
        assert any(s.startswith("pdserve is up") for s in seen), "".join(seen[-40:])
        assert len(ports) == 8 and http_port, (ports, http_port)
        services = {pid: cmd for pid, cmd in children(up.pid).items() if "pdserve.cli" in cmd}
        assert sorted(re.search(r"pdserve\.cli (\w+)", c).group(1) for c in services.values()) == [
            "broker", "decode", "gateway", "prefill"], services
        p = prompt(20, 4242)
        oracle.check(p, complete(http_port, p))  # it serves, with tokens from the request's own KV

        up.kill()  # SIGKILL: `pdserve up` stops nothing itself
        up.wait(10)
        deadline = time.monotonic() + GONE_WITHIN_S
        while any(alive(pid) for pid in services) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {pid: cmd for pid, cmd in services.items() if alive(pid)}
        assert not left, f"still running {GONE_WITHIN_S:.0f}s after `pdserve up` was SIGKILLed: {left}"
        # other tests run stacks on OS-picked ports too: a port one of them took over in the meantime is theirs,
        # a listener of this stack is one whose command line names this test's certificates
        held = {port: owners for port in ports + [http_port] if not bindable(port)
                and (owners := listeners(port)) and any(str(tmp_path) in cmd for cmd in owners.values())}
        assert not held, f"ports still listened on after every service exited: {held}"
    finally:
        if up.poll() is None:
            up.kill()
        for pid in services:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        up.stdout.close()
