"""`pdserve up` with the flags users know (issue 21, point 2), as a user runs it: the model by its Hugging Face id from
a hub cache, served under two names on the host and port asked for, behind the API key given on the command line,
every instance on the device named for it; then an instance given a device the host lacks stops the stack with
that instance's own line."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from tests.integration.helpers import prompt
from tests.integration.test_lifeline import ROOT, children

MODEL = "acme/tiny-chat"
NAMES = [MODEL, "tiny"]
KEY = "sk-test-key-0001"


def hub_with(model_dir: str, cache) -> str:
    """model_dir as `hf download` leaves it in a hub cache: models--ORG--NAME/{refs/main, snapshots/REV/}."""
    rev = "5e1f0c2d9a7b3e4f6a8c0d2e4f6a8b0c1d3e5f70"
    top = cache / ("models--" + MODEL.replace("/", "--"))
    shutil.copytree(model_dir, top / "snapshots" / rev)
    (top / "refs").mkdir()
    (top / "refs" / "main").write_text(rev)
    return str(cache)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def up(argv: list[str], cache: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
    env.update(PYTHONPATH=ROOT, HF_HUB_CACHE=cache)
    return subprocess.Popen([sys.executable, "-u", "-m", "pdserve.cli", "up", "--model", MODEL, "--free-ports", *argv],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def until_up(proc: subprocess.Popen, seen: list[str], timeout: float = 300.0) -> str | None:
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("pdserve is up") or time.monotonic() > deadline:
            return line if line.startswith("pdserve is up") else None
    return None


def call(port: int, path: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers,
                                 data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def proc_file(pid: int, name: str) -> list[str]:
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read().decode().split("\0")


def test_up_serves_a_hub_id_under_its_names_port_and_key_with_each_instance_on_its_device(model_dir, oracle,
                                                                                           tmp_path):
    cache, port = hub_with(model_dir, tmp_path / "hub"), free_port()
    stack = up(["--served-model-name", *NAMES, "--host", "127.0.0.1", "--http-port", str(port), "--api-key", KEY,
                "--device", "cpu", "--decode-instances", "2", "--decode-device", "cpu,cpu",
                "--tls-dir", str(tmp_path / "tls")], cache)
    seen: list[str] = []
    try:
        line = until_up(stack, seen)
        assert line is not None, "".join(seen[-40:])
        assert f"OpenAI HTTP 127.0.0.1:{port} (model {MODEL}, tiny) (API key required)" in line, line

        assert call(port, "/v1/models", key=None)[0] == 401
        assert call(port, "/v1/models", key="sk-wrong-key-01")[0] == 401
        status, models = call(port, "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == NAMES
        p = prompt(24, 2101)
        for name in NAMES:
            status, out = call(port, "/v1/completions", {"model": name, "prompt": p, "max_tokens": 5,
                                                         "temperature": 0, "ignore_eos": True})
            assert status == 200, out
            assert out["model"] == MODEL  # the first name, whichever was asked for
            oracle.check(p, out["choices"][0]["token_ids"])  # computed from the cached snapshot's weights
        status, out = call(port, "/v1/completions", {"model": "tiny-chat", "prompt": p, "max_tokens": 2})
        assert status == 404 and out["error"]["code"] == "model_not_found"

        services = {pid: proc_file(pid, "cmdline") for pid in children(stack.pid)}
        by_role = {}
        for pid, argv in services.items():
            by_role.setdefault(argv[argv.index("pdserve.cli") + 1], []).append(pid)
        assert sorted((r, len(p)) for r, p in by_role.items()) == [("broker", 1), ("decode", 2), ("gateway", 1),
                                                                    ("prefill", 1)]
        for pid, argv in services.items():
            role = argv[argv.index("pdserve.cli") + 1]
            env = proc_file(pid, "environ")
            assert KEY not in " ".join(argv), role  # the key never on a command line ...
            assert (f"PDSERVE_API_KEY={KEY}" in env) == (role == "gateway"), role  # ... and only the gateway has it
            if role in ("prefill", "decode"):
                assert argv[argv.index("--device") + 1] == "cpu" and argv[argv.index("--model") + 1] == MODEL
    finally:
        if stack.poll() is None:
            os.killpg(stack.pid, signal.SIGTERM)
        stack.wait(60)


def test_an_instance_given_a_device_the_host_lacks_stops_up_with_its_own_line(model_dir, tmp_path):
    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0  # so cuda:{count} is never there
    cache = hub_with(model_dir, tmp_path / "hub")
    stack = up(["--decode-instances", "2", "--decode-device", f"cpu,cuda:{count}", "--prefill-device", "cpu"], cache)
    out, _ = stack.communicate(timeout=300)
    assert stack.returncode == 1, out
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"pdserve up: decode1 exited with 1: decode: --device cuda:{count}: torch "
                           f"{torch.__version__} sees {count} CUDA device(s) here"), out[-3000:]
