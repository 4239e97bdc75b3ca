"""`pip install .` gives a working `pdserve` (issue 11): a wheel built from the checkout carries the package
`pdserve` with its generated stubs and nothing named `services` or `bench`; installed into a fresh virtualenv
and run from a folder outside the repository, it prints pyproject's version, writes a checkpoint, serves it with
`pdserve up` and answers `pdserve generate` with the tokens the reference oracle (tests/oracle.py, on the same
checkpoint bytes) agrees with; SIGTERM leaves nothing running. The fresh venv takes its dependencies (torch, grpc, Mooncake) from the shared
venv's site-packages through a .pth line instead of downloading them; that line adds the folder only, so the
shared venv's editable pdserve (a finder its own .pth installs) is not seen: `import pdserve` is the wheel's."""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.oracle import Oracle

ROOT = Path(__file__).resolve().parents[2]
UP = re.compile(r"pdserve is up: gateway gRPC (\S+),")


def run(cmd, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=kw.pop("timeout", 300), **kw)
    assert out.returncode == 0, f"{cmd}: exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the wheel built from a copy of the checkout's files (the build writes build/ and
    *.egg-info into its source folder: the checkout stays untouched)."""
    tmp = tmp_path_factory.mktemp("pip")
    files = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout
    src = tmp / "src"
    for rel in filter(None, files.split("\0")):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes((ROOT / rel).read_bytes())
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"),
         str(src)])
    wheel, = (tmp / "dist").glob("pdserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for stub in ("common", "gateway", "prefill", "decode", "broker"):
        assert f"pdserve/v1/{stub}_pb2.py" in names and f"pdserve/v1/{stub}_pb2_grpc.py" in names, stub
    # every file of the package in the checkout (a data file too: package_data in setup.py) is in the wheel
    tracked = [f for f in files.split("\0") if f.startswith(("services/", "bench/")) and "/results/" not in f
               and not f.endswith((".md", ".gitignore"))]
    assert tracked and [f for f in tracked if f.replace("services/", "pdserve/", 1).replace(
        "bench/", "pdserve/bench/", 1) not in names] == []
    assert not [n for n in names if n.split("/")[0] in ("services", "bench", "tests")]
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "shared-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([sys.executable, "-m", "pip", "--python", str(venv / "bin/python"), "install", "-q", "--no-deps",
         str(wheel)])
    return venv


def env() -> dict:
    """Without PYTHONPATH: the tests run the checkout through it, the installed command must not."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def pids_running(venv: Path) -> list[int]:
    """Processes started from the fresh venv's interpreter or scripts."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and str(venv).encode() in (d / "cmdline").read_bytes():
                found.append(int(d.name))
        except OSError:
            pass
    return found


def test_installed_pdserve_serves_from_outside_the_repository(installed, tmp_path, model_dir, oracle):
    pdserve = str(installed / "bin/pdserve")
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    code = "import pdserve.v1.gateway_pb2, pdserve; print(pdserve.__file__)"
    where = run([str(installed / "bin/python"), "-c", code], cwd=cwd, env=env()).stdout.strip()
    assert where.startswith(str(installed)), where
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert run([pdserve, "--version"], cwd=cwd, env=env()).stdout == f"pdserve {version}\n"
    model = cwd / "model"
    run([pdserve, "make-model", "--out", str(model)], cwd=cwd, env=env())
    assert (model / "config.json").exists() and (model / "model.safetensors").exists()
    # the reference runs on the served bytes: the session's oracle where model_dir holds the same weights (the
    # default seed), else one of its own (a models/pdserve-tiny written by an older make-model)
    same = all((model / f).read_bytes() == (Path(model_dir) / f).read_bytes()
               for f in ("config.json", "model.safetensors"))
    reference = oracle if same else Oracle(str(model))

    up = subprocess.Popen([pdserve, "up", "--model", str(model), "--free-ports"], cwd=cwd, env=env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in up.stdout], daemon=True).start()
    seen, gateway = [], None
    try:
        deadline = time.monotonic() + 180
        while gateway is None and time.monotonic() < deadline and up.poll() is None:
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                continue
            m = UP.search(seen[-1])
            gateway = m.group(1) if m else None
        assert gateway, f"pdserve up did not come up (exit {up.poll()}):\n{''.join(seen[-40:])}"
        assert len(pids_running(installed)) >= 5  # up, broker, prefill, decode, gateway

        prompt = [11, 42, 7, 300, 5, 19]
        out = run([pdserve, "generate", "--gateway", gateway, "--json", "--max-tokens", "12", "--ignore-eos",
                   "--prompt-token-ids", ",".join(map(str, prompt))], cwd=cwd, env=env())
        result = json.loads(out.stdout)
        assert len(result["token_ids"]) == 12 and result["finish_reason"] == "length", result
        reference.check(prompt, result["token_ids"])

        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
    assert pids_running(installed) == [], "processes left running after pdserve up stopped"
