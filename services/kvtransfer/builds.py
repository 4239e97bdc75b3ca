"""Mooncake's two builds, and whether the one installed can load: `python -m pdserve.kvtransfer.builds cpu|cuda`.

pyproject's `cpu` extra installs mooncake-transfer-engine-non-cuda, its `cuda` extra mooncake-transfer-engine, whose
engine.so links libcudart.so.12 (the nvidia-cuda-runtime-cu12 wheel of the same extra: torch's own wheel brings
CUDA 13), libcuda.so.1 (the driver: on Kubernetes the NVIDIA container toolkit mounts it from the node) and
libmlx5.so.1 (Debian's ibverbs-providers). The wheel's runtime folder is on no loader path, so it is loaded by path
first (load_cuda_runtime) and engine.so's NEEDED entry matches it by soname. `deploy/install.sh verify` runs this
module where it installed: a host after `make setup`, each image at build time, where no GPU exists; so it checks
the build and the libraries with ldd, and never imports the CUDA build.
"""
from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from importlib import metadata

BUILDS = {"cpu": "mooncake-transfer-engine-non-cuda", "cuda": "mooncake-transfer-engine"}
CUDA_RUNTIME = ("nvidia-cuda-runtime-cu12", "nvidia/cuda_runtime/lib/libcudart.so.12")
# libraries the host supplies at run time, not the image: the CUDA driver comes with the node's GPU
FROM_THE_NODE = {"cuda": {"libcuda.so.1"}, "cpu": set()}
# where a library engine.so links comes from, for the message when it is missing
SOURCES = {"libibverbs.so.1": "Debian's libibverbs1", "librdmacm.so.1": "Debian's librdmacm1",
           "libnuma.so.1": "Debian's libnuma1", "libcurl.so.4": "Debian's libcurl4",
           "libmlx5.so.1": "Debian's ibverbs-providers", "libcudart.so.12": "the nvidia-cuda-runtime-cu12 wheel"}


def installed() -> dict[str, str]:
    """{distribution: version} of the Mooncake builds installed."""
    out = {}
    for dist in BUILDS.values():
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def cuda_runtime_path() -> str | None:
    """libcudart.so.12 as the nvidia-cuda-runtime-cu12 wheel installed it, or None without that wheel."""
    dist, rel = CUDA_RUNTIME
    try:
        return str(metadata.distribution(dist).locate_file(rel))
    except metadata.PackageNotFoundError:
        return None


def load_cuda_runtime() -> str | None:
    """Before Mooncake's CUDA build is imported: its libcudart.so.12, loaded by path so that engine.so finds it
    already loaded. None where it is not needed (the non-CUDA build) or not there as a wheel (a host's own CUDA 12
    runtime on the loader's path serves then, or the import names what is missing)."""
    if BUILDS["cuda"] not in installed():
        return None
    path = cuda_runtime_path()
    if path is None or not os.path.exists(path):
        return None
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return path


def engine_library(dist: str) -> str:
    return str(metadata.distribution(dist).locate_file("mooncake/engine.so"))


def unresolved(library: str, preload: str | None = None) -> list[str]:
    """The libraries `library` links that the loader does not find, as ldd reports them (with preload loaded
    first, as load_cuda_runtime does)."""
    env = {**os.environ, **({"LD_PRELOAD": preload} if preload else {})}
    out = subprocess.run(["ldd", library], capture_output=True, text=True, env=env, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"ldd {library} failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    return parse_ldd(out.stdout)


def parse_ldd(text: str) -> list[str]:
    return re.findall(r"^\s*(\S+) => not found", text, re.M)


def problems(variant: str) -> list[str]:
    """Every reason the Mooncake build installed here cannot serve this variant; empty when it can."""
    want = BUILDS[variant]
    have = installed()
    found = ", ".join(f"{d} {v}" for d, v in sorted(have.items())) or "none"
    if set(have) != {want}:
        return [f"the {variant} variant needs {want} alone (pyproject's `{variant}` extra); installed: {found}"]
    out = []
    engine = engine_library(want)
    preload = None
    if variant == "cuda":
        preload = cuda_runtime_path()
        if preload is None or not os.path.exists(preload):
            out.append(f"Mooncake's CUDA build links libcudart.so.12 and {CUDA_RUNTIME[0]} is not installed "
                       f"(pyproject's `cuda` extra pins it){'' if preload is None else f': no {preload}'}")
            preload = None
    missing = [lib for lib in unresolved(engine, preload) if lib not in FROM_THE_NODE[variant]]
    if missing:
        out.append(f"{engine} links {len(missing)} libraries the loader does not find: "
                   + ", ".join(f"{lib} ({SOURCES.get(lib, 'unknown source')})" for lib in missing))
    return out


def torch_problems(variant: str) -> list[str]:
    """A CUDA image needs torch's CUDA build (a CPU one would keep every tensor off the GPU)."""
    if variant != "cuda":
        return []
    import torch
    if torch.version.cuda is None:
        return [f"torch {torch.__version__} is a CPU build: the cuda variant needs the CUDA wheel (PyPI's)"]
    return []


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in BUILDS:
        print(f"usage: python -m pdserve.kvtransfer.builds {'|'.join(BUILDS)}", file=sys.stderr)
        return 2
    variant = argv[0]
    found = problems(variant) + torch_problems(variant)
    for p in found:
        print(f"verify {variant}: {p}", file=sys.stderr)
    if found:
        return 1
    node = " but " + ", ".join(sorted(FROM_THE_NODE[variant])) + " (the node supplies it)" if FROM_THE_NODE[variant] \
        else ""
    print(f"verify {variant}: {BUILDS[variant]} {installed()[BUILDS[variant]]}; every library engine.so links "
          f"resolves{node}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
