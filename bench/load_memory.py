"""Host memory while a checkpoint loads (issue 19, point 4): peak RSS above the process's own, against the
checkpoint's bytes and the loaded weights', for the checkpoint's dtype and for float32.

`python -m pdserve.bench.load_memory [--preset small] [--shards 4]` writes a bf16 checkpoint in that many shards
and loads it in a fresh process per row. Shard by shard, the host holds the weights plus about one shard (the
mapped file); the loader before it held every shard's tensors beside the converted copy (3x the checkpoint).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

MiB = 2**20


def _high_water() -> int:
    """This process's peak RSS: VmHWM, not ru_maxrss, which a child inherits from the parent that forked it."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _child(path: str, dtype: str) -> None:
    import torch

    from ..engine.config import ModelConfig
    from ..engine.loader import load_model, weight_nbytes
    from ..engine.model import CausalLM
    with torch.device("meta"):  # everything but the weights: what the row's peak is measured above
        CausalLM(ModelConfig.from_dir(path))
    base = _high_water()
    weights = weight_nbytes(load_model(path, "cpu", dtype))
    peak = _high_water()
    print(json.dumps({"weights": weights, "above": peak - base}))


def _shard(src: str, out: str, shards: int) -> int:
    from safetensors.torch import load_file, save_file
    state = load_file(os.path.join(src, "model.safetensors"))
    names, weight_map = sorted(state), {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k].contiguous() for k in names[i::shards]}, os.path.join(out, fname))
        weight_map.update({k: fname for k in names[i::shards]})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    os.remove(os.path.join(src, "model.safetensors"))
    return sum(v.nbytes for v in state.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return _child(*args.child)
    from ..engine.make_model import make_model
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(tmp, args.preset, dtype="bfloat16")
        ckpt = _shard(path, path, args.shards)
        print(f"{args.preset} preset, bf16, {args.shards} shards: checkpoint {ckpt / MiB:.1f} MiB "
              f"(one shard ~{ckpt / args.shards / MiB:.1f} MiB)")
        for dtype in ("auto", "float32"):
            run = subprocess.run([sys.executable, "-m", "pdserve.bench.load_memory", "--child", path, dtype],
                                 capture_output=True, text=True, check=True)
            row = json.loads(run.stdout.strip().splitlines()[-1])
            print(f"--dtype {dtype:8s} weights {row['weights'] / MiB:7.1f} MiB  peak RSS above the process "
                  f"{row['above'] / MiB:7.1f} MiB  = weights + {(row['above'] - row['weights']) / MiB:6.1f} MiB "
                  f"({row['above'] / ckpt:.2f}x the checkpoint)")


if __name__ == "__main__":
    main()
