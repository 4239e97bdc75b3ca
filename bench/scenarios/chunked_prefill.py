"""A prompt prefilled in chunks against the same prompt in one pass:
`python -m pdserve.bench.scenarios.chunked_prefill`.

For each prompt length and chunk size, one process times the whole prompt in one pass and the same prompt as
consecutive chunks (each one a pass of its own that attends to the chunks before it where their KV lies in the pool,
as prefill runs a prompt longer than --prefill-max-batch-tokens), the two alternating rep after rep on the same
runner and pool, from a thread with the service's intra-op threads (all the cores this process may use). It prints
the median of each and their ratio, which the issue bounds at 1.1x for 2 x 2,048 against 4,096, and checks that the
two give the same greedy token and logits within 1e-4 (a ratio over different arithmetic would mean nothing).

This machine's speed drifts within minutes; only the interleaved pairs compare. Prefill runs its threads with
OMP_WAIT_POLICY=PASSIVE: set it in the environment to time the same (torch reads it when it loads).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from pdserve.engine.runner import Chunk, ModelRunner, available_cpus

from ..harness.common import ROOT

PAGE_SIZE = 16


def measure(runner: ModelRunner, length: int, chunk: int, reps: int, seed: int = 0) -> dict:
    """{length, chunk, whole_ms, chunked_ms, ratio} from reps alternating pairs (order swapped every pair)."""
    g = torch.Generator().manual_seed(seed + length)
    ids = torch.randint(2, runner.config.vocab_size, (length,), generator=g).tolist()
    pages = list(range(-(-length // PAGE_SIZE)))
    bounds = list(range(0, length, chunk)) + [length]

    def whole() -> torch.Tensor:
        return runner.prefill(ids, pages)

    def chunked() -> torch.Tensor:
        out = None
        for a, b in zip(bounds, bounds[1:]):
            out = runner.prefill_batch([Chunk(ids[a:b], a, pages)])[0]
        return out

    one, parts = whole(), chunked()  # warm, and the same answer either way
    if one.argmax(-1).tolist() != parts.argmax(-1).tolist() or (one - parts).abs().max().item() > 1e-4:
        raise SystemExit(f"{length} tokens in chunks of {chunk}: logits differ from the whole pass by "
                         f"{(one - parts).abs().max().item():.2e}")
    times: dict[str, list[float]] = {"whole": [], "chunked": []}
    for r in range(reps):
        for name, fn in ((("whole", whole), ("chunked", chunked)) if r % 2 == 0 else
                         (("chunked", chunked), ("whole", whole))):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    w, c = statistics.median(times["whole"]) * 1e3, statistics.median(times["chunked"]) * 1e3
    return {"length": length, "chunk": chunk, "whole_ms": w, "chunked_ms": c, "ratio": c / w}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 prog="python -m pdserve.bench.scenarios.chunked_prefill")
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "pdserve-tiny"))
    ap.add_argument("--cells", default="4096x2048,4096x1024,1024x512",
                    help="PROMPTxCHUNK, comma-separated")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads; 0: every core, as prefill takes")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or available_cpus())
    cells = [tuple(int(x) for x in c.split("x")) for c in args.cells.split(",")]
    longest = max(n for n, _ in cells)
    runner = ModelRunner(args.model, num_pages=-(-longest // PAGE_SIZE) + 1, page_size=PAGE_SIZE,
                         prefill_only=True)
    with ThreadPoolExecutor(1) as ex:  # prefill computes in a thread of its own, not the main one
        rows = [ex.submit(measure, runner, n, c, args.reps).result() for n, c in cells]
    print(f"threads {torch.get_num_threads()}, {args.reps} alternating pairs a cell, load average "
          f"{os.getloadavg()[0]:.2f}")
    print("| prompt | chunk | one pass ms | in chunks ms | chunks / one pass |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['length']:,} | {r['chunk']:,} | {r['whole_ms']:.1f} | {r['chunked_ms']:.1f} "
              f"| {r['ratio']:.3f}× |")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
