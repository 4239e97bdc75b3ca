#!/usr/bin/env bash
# The `make bench` table on a CUDA machine: every engine (pdserve's prefill and decode, co-located, transformers)
# on the GPU, Mooncake's CUDA build. Usage: bench/gpu.sh [--quick] [--no-profile]   (or: make bench-gpu)
# Results go to bench/out/cuda/ (PDSERVE_BENCH_RESULTS), never over a CPU run's tables in bench/out/.
# A fresh machine needs git, make and an NVIDIA driver; the venv (.venv-cuda, VENV to change) is set up by the
# Makefile, whose installer takes the `cuda` extra wherever nvidia-smi exists.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-cuda}
OUT=${PDSERVE_BENCH_RESULTS:-bench/out/cuda}

if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "bench/gpu.sh: no nvidia-smi on this machine: it needs an NVIDIA GPU and its driver" >&2
  exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
make setup VENV="$VENV"
PY="$VENV/bin/python"
# Mooncake's CUDA build links libcudart.so.12, which the pinned nvidia-cuda-runtime-cu12 wheel provides
# (torch's own wheel bundles CUDA 13): pdserve's services load it from the wheel themselves
# (services/kvtransfer/builds.py); the benchmarks' raw Mooncake client and the import below find it on this path
CUDART=$("$PY" -c 'import os, nvidia.cuda_runtime as m; print(os.path.join(list(m.__path__)[0], "lib"))')
export LD_LIBRARY_PATH="$CUDART${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
"$PY" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"bench/gpu.sh: torch {torch.__version__} sees no CUDA device")
import mooncake.engine  # noqa: F401  (the CUDA build: an import error here names the missing library)
print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; Mooncake imports")
PY
mkdir -p "$OUT"
export PDSERVE_BENCH_RESULTS="$OUT"
echo "bench/gpu.sh: results go to $OUT/ (bench-<mode>.md, .json, plots, profiles)"
"$PY" -m pdserve.bench.run --device cuda "$@"
echo "bench/gpu.sh: done; the table is $OUT/bench-$([[ " $* " == *" --quick "* ]] && echo quick || echo full).md"
