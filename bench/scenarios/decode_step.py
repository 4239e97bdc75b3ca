"""One decode step against its memory-bandwidth floor: `python -m pdserve.bench.scenarios.decode_step`.

floor = (bytes of weights read per step + bytes of KV read per step) / read bandwidth, the bandwidth measured
in the same run as the best of BW_REPS `torch.sum` passes over a BW_BYTES float32 tensor, with the thread
count the step runs with. The weights are every parameter but the embedding table (of which a step reads B
rows); the KV is what the B sequences attend: (position + 1) tokens each. The pool is filled with random
values, not a prefill (the step's cost does not depend on them), and each sequence's pages are granted
lowest id first, as the broker grants them (--layout scattered: drawn at random from a pool twice the size,
as a pool looks after a load peak). Times are the best of --reps steps: on a shared machine other work only
adds, so the best is the closest to the code's own cost; the run prints the load average.

With --baseline REV, each cell also runs the native step built from REV's csrc beside the working tree's, the two
steps alternating on the same pool and inputs (best wall and best CPU time of each): a change to a kernel is judged
by the whole step it runs in, on the same load.

As a step of `pdserve bench` (DecodeStepStep, mixed into Bench), this module runs itself in its own process and
keeps its Markdown table and its JSON rows {batch, context, step_ms, floor_ms, ratio} for the report.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.kv_pool import PoolLayout

from .attention_memory import table as attention_memory_table
from ..harness.common import MODELS, RESULTS, ROOT, ensure_model, log

BW_BYTES, BW_REPS = 1 << 30, 5
PAGE_SIZE = 16


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bandwidth(device: torch.device) -> float:
    """Bytes per second of a streaming read far larger than the last-level cache."""
    x = torch.ones(BW_BYTES // 4, device=device)
    best = float("inf")
    for _ in range(BW_REPS):
        _sync(device)
        t0 = time.perf_counter()
        x.sum()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return BW_BYTES / best


def weight_bytes(model: torch.nn.Module, batch: int) -> int:
    emb = model.model.embed_tokens.weight
    read = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters() if p is not emb}
    # a tied lm_head reads the whole table; otherwise the step reads its B rows of it
    rows = emb.shape[0] if model.lm_head.weight.data_ptr() == emb.data_ptr() else batch
    return sum(read.values()) + rows * emb.shape[1] * emb.element_size()


def _best_ms(step, reps: int, device: torch.device) -> float:
    """Best step time of reps (other work on a shared machine only adds to a step)."""
    best = float("inf")
    for i in range(reps + 1):  # the first step warms up the allocator and first-touches the pages
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        best = min(best, time.perf_counter() - t0) if i else best
    return best * 1e3


def _interleaved_ms(runner, steps: dict, args: tuple, reps: int) -> dict[str, tuple[float, float]]:
    """{name: (best wall ms, best CPU ms)} of runner.decode(*args) with each native step in turn, one step of each
    per round, so a load that comes and goes weighs on both alike."""
    best = {name: [float("inf"), float("inf")] for name in steps}
    for i in range(reps + 1):  # the first round warms up
        for name, native_step in steps.items():
            runner.native_step = native_step
            c0, t0 = time.thread_time(), time.perf_counter()
            runner.decode(*args)
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            if i:
                best[name] = [min(best[name][0], wall), min(best[name][1], cpu)]
    runner.native_step = steps["current"]
    return {name: (w * 1e3, c * 1e3) for name, (w, c) in best.items()}


def baseline_library(rev: str):
    """The native library built from csrc as it was at git revision rev, declared for NativeDecoder."""
    import ctypes
    import tempfile

    from pdserve.engine import native
    from pdserve.engine.native_build import SOURCES, build

    rel = os.path.relpath(os.path.dirname(SOURCES[0]), ROOT)
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, check=True).stdout  # noqa: E731
    out = tempfile.mkdtemp(prefix="pdserve-baseline-")
    sources = []
    for name in git("ls-tree", "--name-only", f"{rev}:{rel}").decode().split():
        if name.endswith(".c"):
            sources.append(os.path.join(out, name))
            with open(sources[-1], "wb") as f:
                f.write(git("show", f"{rev}:{rel}/{name}"))
    return native.declare(ctypes.CDLL(build(out, sorted(sources))))


def _runner(path: str, num_pages: int, device: torch.device):
    from pdserve.engine.runner import ModelRunner

    runner = ModelRunner(path, num_pages=num_pages, page_size=PAGE_SIZE, device=device)
    runner.pool.kv.normal_(0, 0.5)
    return runner


def _tables(batch: int, pages_per_seq: int, scattered: bool) -> tuple[int, list[list[int]]]:
    """(pool pages, each sequence's page ids)."""
    num_pages = batch * pages_per_seq * (2 if scattered else 1)
    ids = random.Random(0).sample(range(num_pages), batch * pages_per_seq) if scattered else range(num_pages)
    return num_pages, [list(ids[b * pages_per_seq:(b + 1) * pages_per_seq]) for b in range(batch)]


def measure(preset: str, batches: list[int], contexts: list[int], reps: int, bw: float, max_pool_gib: float,
            device: torch.device, scattered: bool = False, baseline=None) -> list[dict]:
    """baseline: a library from baseline_library(), timed beside the current build in each cell."""
    path = ensure_model(preset)
    cfg = ModelConfig.from_dir(path)
    page_nbytes = PoolLayout.for_model(cfg, PAGE_SIZE, "float32").page_nbytes
    rows = []
    for ctx in contexts:
        pages_per_seq = -(-ctx // PAGE_SIZE)
        for batch in batches:
            need = batch * pages_per_seq * page_nbytes * (2 if scattered else 1)
            if need > max_pool_gib * (1 << 30):
                rows.append(dict(preset=preset, batch=batch, context=ctx, skipped=f"KV {need / (1 << 30):.1f} GiB "
                                 f"over --max-pool-gib {max_pool_gib:g}"))
                continue
            num_pages, tables = _tables(batch, pages_per_seq, scattered)
            runner = _runner(path, num_pages, device)
            args = ([5] * batch, [ctx - 1] * batch, tables)
            kv = batch * ctx * page_nbytes // PAGE_SIZE
            w = weight_bytes(runner.model, batch)
            extra = {}
            if baseline is not None and runner.native_step is not None:
                from pdserve.engine.native import NativeDecoder

                steps = {"current": runner.native_step,
                         "baseline": NativeDecoder(runner.model, runner.pool.kv, baseline)}
                ms = _interleaved_ms(runner, steps, args, reps)
                step_ms = ms["current"][0]
                extra = dict(step_cpu_ms=ms["current"][1], baseline_ms=ms["baseline"][0],
                             baseline_cpu_ms=ms["baseline"][1])
            else:
                step_ms = _best_ms(lambda: runner.decode(*args), reps, device)
            rows.append(dict(preset=preset, batch=batch, context=ctx, weight_mb=w / 1e6, kv_mb=kv / 1e6,
                             floor_ms=(w + kv) / bw * 1e3, step_ms=step_ms, **extra))
            print(_row(rows[-1]), flush=True)
            runner = None  # its pool goes before the next cell's is allocated
    return rows


def _row(r: dict) -> str:
    if "skipped" in r:
        return f"| {r['preset']} | {r['batch']} | {r['context']} | skipped: {r['skipped']} | | | |"
    line = (f"| {r['preset']} | {r['batch']} | {r['context']} | {r['weight_mb']:.1f} | {r['kv_mb']:.1f} | "
            f"{r['floor_ms']:.2f} | {r['step_ms']:.2f} | {r['step_ms'] / r['floor_ms']:.2f}× |")
    if "baseline_ms" in r:
        line += (f" {r['baseline_ms']:.2f} | {r['baseline_ms'] / r['floor_ms']:.2f}× | {r['step_cpu_ms']:.2f} | "
                 f"{r['baseline_cpu_ms']:.2f} |")
    return line


HEADER = "| preset | batch | context | weights MB | KV MB | floor ms | step ms | step / floor |\n|---|---|---|---|---|---|---|---|"
BASELINE_HEADER = ("| preset | batch | context | weights MB | KV MB | floor ms | step ms | step / floor | baseline ms "
                   "| baseline / floor | step CPU ms | baseline CPU ms |\n" + "|---" * 12 + "|")


def profile_step(preset: str, batch: int, ctx: int, device: torch.device, top: int = 15) -> str:
    """torch.profiler's top ops of the new step: what dominates where the floor is not reached."""
    from torch.profiler import ProfilerActivity, profile

    pages_per_seq = -(-ctx // PAGE_SIZE)
    runner = _runner(ensure_model(preset), batch * pages_per_seq, device)
    tables = [list(range(b * pages_per_seq, (b + 1) * pages_per_seq)) for b in range(batch)]
    runner.decode([5] * batch, [ctx - 1] * batch, tables)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                 ) as prof:
        for _ in range(5):
            runner.decode([5] * batch, [ctx - 1] * batch, tables)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m pdserve.bench.scenarios.decode_step")
    ap.add_argument("--presets", default="tiny,small" if os.path.isdir(os.path.join(MODELS, "pdserve-small"))
                    else "tiny", help="checkpoints (small is written to bench/.models on first use)")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--contexts", default="128,1024,4064")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads; 0: what a service takes (half the cores)")
    ap.add_argument("--max-pool-gib", type=float, default=4.0, help="cells whose KV is larger are skipped")
    ap.add_argument("--profile", default="tiny,16,1024", help="preset,batch,context to profile; '' for none")
    ap.add_argument("--layout", default="contiguous", choices=["contiguous", "scattered"],
                    help="each sequence's pages: lowest ids first, or scattered over a pool twice the size")
    ap.add_argument("--attention-memory-pools", default="65536", help="pool sizes in pages (of 16 tokens) of the "
                    "attention memory table (bench/scenarios/attention_memory.py); '' for none")
    ap.add_argument("--baseline", default="", help="a git revision: each cell also times the native step built from "
                    "its csrc, alternating with the current one")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU host (bench/gpu.sh)")
    ap.add_argument("--out", default="", help=f"also write the report to this file (e.g. {RESULTS}/decode-step.md)")
    ap.add_argument("--json", default="", help="also write the measured rows here: {preset, batch, context, step_ms "
                                               "(the current step), floor_ms, ratio}")
    args = ap.parse_args(argv)
    from pdserve.engine.runner import set_threads

    set_threads(args.threads)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    device = torch.device(args.device)
    bw = read_bandwidth(device)
    lines = ["# Decode step against its memory-bandwidth floor\n",
             f"device {device}, threads {torch.get_num_threads()}, read bandwidth {bw / 1e9:.1f} GB/s (best of {BW_REPS} sums over "
             f"{BW_BYTES >> 20} MiB), pages {args.layout}, load average before {os.getloadavg()[0]:.1f}, "
             f"best of {args.reps} steps" + (f", beside the native step of {args.baseline}" if args.baseline else "")
             + "\n", BASELINE_HEADER if args.baseline else HEADER]
    print("\n".join(lines), flush=True)
    measured = []
    for preset in args.presets.split(","):
        measured += measure(preset, ints(args.batches), ints(args.contexts), args.reps, bw, args.max_pool_gib, device,
                            args.layout == "scattered", baseline_library(args.baseline) if args.baseline else None)
    lines += [_row(r) for r in measured]
    lines.append(f"\nload average after {os.getloadavg()[0]:.1f}")
    if args.profile:
        preset, batch, ctx = args.profile.split(",")
        lines += [f"\n## Top ops of the new step: {preset}, batch {batch}, context {ctx} (5 steps)\n", "```",
                  profile_step(preset, int(batch), int(ctx), device), "```"]
        print("\n".join(lines[-4:]))
    if args.attention_memory_pools:
        memory = ["", *attention_memory_table(ints(args.attention_memory_pools))]
        print("\n".join(memory), flush=True)
        lines += memory
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.json:
        rows = [dict(preset=r["preset"], batch=r["batch"], context=r["context"], step_ms=r["step_ms"],
                     floor_ms=r["floor_ms"], ratio=r["step_ms"] / r["floor_ms"])
                for r in measured if "skipped" not in r]
        with open(args.json, "w") as f:
            json.dump({"bandwidth_gbps": bw / 1e9, "rows": rows}, f, indent=1)


ROW_KEYS = ("batch", "context", "step_ms", "floor_ms", "ratio")


def read_rows(path: str) -> list[dict]:
    """The JSON rows decode_step wrote (a list, or {"rows": [...]}), each checked for the agreed keys."""
    with open(path) as f:
        doc = json.load(f)
    rows = doc.get("rows") if isinstance(doc, dict) else doc
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{path}: expected a non-empty list of rows (or {{'rows': [...]}}), got {type(doc).__name__}")
    for i, r in enumerate(rows):
        missing = [k for k in ROW_KEYS if k not in r]
        if missing:
            raise ValueError(f"{path}: row {i} lacks {missing} (has {sorted(r)})")
    return rows


class DecodeStepStep:
    """Mixed into Bench (uses its plan and res)."""

    def decode_step(self) -> None:
        path = os.path.join(RESULTS, f"decode-step-{self.plan.mode}.json")
        log("decode step against its memory-bandwidth floor (python -m pdserve.bench.scenarios.decode_step) ...")
        # quick: the target cell and its neighbours on the tiny checkpoint; full: every batch, context and preset
        grid = ["--presets", "tiny", "--batches", "1,16", "--contexts", "128,1024", "--reps", "5"] \
            if self.plan.mode == "quick" else []
        out = subprocess.run([sys.executable, "-m", "pdserve.bench.scenarios.decode_step", "--json", path, *grid],
                             capture_output=True, text=True, cwd=ROOT, timeout=900, stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            raise RuntimeError(f"decode_step exited {out.returncode}: {out.stderr[-2000:]}")
        self.res["decode_step"] = {"rows": read_rows(path), "table": out.stdout.strip(),
                                   "file": os.path.relpath(path, ROOT)}


if __name__ == "__main__":
    main()
