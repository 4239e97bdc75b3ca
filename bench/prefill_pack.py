"""Prefill throughput, packed vs one prompt at a time, side by side in one run (issue 12, point 2).

`python -m pdserve.bench.prefill_pack [--model DIR] [--prompts 16] [--tokens 128] [--repeats 5]` prints tokens/s
of both and their ratio (median of the repeats, alternating the two so load drifts hit both alike).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from ..engine.runner import Chunk, ModelRunner, set_threads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/pdserve-tiny")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    set_threads(args.threads)
    ps = 16
    per = -(-args.tokens // ps)
    runner = ModelRunner(args.model, args.prompts * per, ps, device=args.device)
    r = random.Random(0)
    prompts = [[r.randrange(2, runner.config.vocab_size) for _ in range(args.tokens)] for _ in range(args.prompts)]
    pages = [list(range(i * per, (i + 1) * per)) for i in range(args.prompts)]

    def one_at_a_time():
        for ids, pg in zip(prompts, pages):
            runner.prefill(ids, pg)

    def packed():
        runner.prefill_batch([Chunk(ids, 0, pg) for ids, pg in zip(prompts, pages)])

    def timed(fn) -> float:
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    one_at_a_time(), packed()  # warm-up
    times = {"one at a time": [], "packed": []}
    for _ in range(args.repeats):
        times["one at a time"].append(timed(one_at_a_time))
        times["packed"].append(timed(packed))
    total = args.prompts * args.tokens
    rate = {k: total / statistics.median(v) for k, v in times.items()}
    print(f"{args.prompts} x {args.tokens}-token prompts on {runner.device}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}:")
    for k, v in rate.items():
        print(f"  {k:14s} {v:10.0f} tokens/s  ({statistics.median(times[k]) * 1000:.1f} ms)")
    print(f"  packed / one at a time: {rate['packed'] / rate['one at a time']:.2f}x")


if __name__ == "__main__":
    main()
