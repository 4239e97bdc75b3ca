"""Prefill's KV write under load, in service, against raw Mooncake moving the same requests' bytes the same way.

In service: prefill's `pdserve_kv_transfer_seconds` (zero the tail, CRC-32C, tags, data, tags) per request, for
prompts of PROMPT tokens at concurrency 1 and C (max_tokens 2: the prefill side is what is measured). Raw: the same
bytes per request (one data run, then one tag run) written back to back, and C such requests at once from a thread
pool, as prefill's servicer runs them (one thread per prompt), each timed from its own start. At concurrency C the
C writes of a pass share the wire, so a write's own time is compared with raw C-at-once, not with one write alone.

Variants are pdserve trees put ahead of the checkout on PYTHONPATH (a folder holding a `pdserve/` package, e.g. a
copy of services/ at another commit, renamed); `tree` is the checkout. Rounds run the variants interleaved:

    python -m pdserve.bench.scenarios.transfer_load --variants /tmp/old,tree --rounds 4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from ..harness.common import ensure_model, log
from ..harness.stack import BenchStack
from ..harness.workload import make_prompts

TAG_NBYTES = 64


def in_service(model: str, variant: str, prompt_len: int, concurrency: int, num: int, seed: int) -> list[dict]:
    env_before = os.environ.get("PYTHONPATH")
    if variant == "tree":
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = variant
    try:
        stack = BenchStack(model)
    finally:
        if env_before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env_before
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    rows = []
    try:
        stack.run("pdserve", "transfer", make_prompts(prompt_len, 8, vocab, seed=1), 4, max_tokens=2)  # warm-up
        for c in (concurrency, 1):
            n = num if c > 1 else max(8, num // 4)
            s, _ = stack.run("pdserve", "transfer", make_prompts(prompt_len, n, vocab, seed=seed + c), c, max_tokens=2)
            e = s.extra
            count = max(e["transfer_count"], 1)
            rows.append({"variant": variant, "prompt_len": prompt_len, "concurrency": c,
                         "transfer_ms": 1e3 * e["transfer_sum"] / count, "transfers": e["transfer_count"],
                         "bytes": e["transfer_bytes"] / count, "ttft_p50_ms": 1e3 * s.ttft_p50,
                         "prefill_cpu_s": e["cpu"].get("prefill", 0.0), "other_cores": e["other_cores"],
                         "errors": s.num_errors})
    finally:
        stack.close()
    return rows


def raw(nbytes: int, pages: int, concurrency: int, repeats: int) -> dict:
    """Raw Mooncake per-request seconds for nbytes (data and tags): back to back, and `concurrency` at once."""
    from ..peers.mooncake_raw import RawMooncake
    from ..scenarios.transfer import _quiet_stderr

    tags = pages * TAG_NBYTES
    data = int(nbytes - tags)
    with _quiet_stderr():
        mc = RawMooncake(max(64 << 20, 2 * concurrency * data))
        try:
            alone = sorted(mc.measure(data, tags, repeats))
            stride = -(-data // 4096) * 4096
            per: list[float] = []
            with ThreadPoolExecutor(concurrency) as pool:
                for _ in range(repeats):
                    per += pool.map(lambda i: _write_at(mc, i * stride, data, tags), range(concurrency))
        finally:
            mc.close()
    per.sort()
    return {"alone_ms": 1e3 * alone[len(alone) // 2], "together_ms": 1e3 * per[len(per) // 2],
            "together_mean_ms": 1e3 * statistics.mean(per)}


def _write_at(mc, offset: int, data: int, tags: int) -> float:
    from pdserve.kvtransfer.engine import Run

    t = time.perf_counter()
    mc.engine.write(mc.remote["session"], [Run(mc.data.data_ptr() + offset, mc.remote["data"] + offset, data)], "data")
    mc.engine.write(mc.remote["session"], [Run(mc.tags.data_ptr(), mc.remote["tags"] + offset // 1024, tags)], "tags")
    return time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.scenarios.transfer_load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="tree", help="comma-separated: 'tree' or folders holding a pdserve/ package")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=96, help="per round at the concurrency (a quarter at 1)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--out", default="", help="also write every row as JSON lines here")
    args = p.parse_args(argv)
    os.environ.setdefault("GLOG_minloglevel", "2")
    model = ensure_model(args.preset)
    variants = args.variants.split(",")
    rows: list[dict] = []
    for rnd in range(args.rounds):
        for v in variants:
            for row in in_service(model, v, args.prompt, args.concurrency, args.requests, seed=100 + rnd):
                row["round"] = rnd
                rows.append(row)
                log(json.dumps(row))
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
    nbytes = statistics.median(r["bytes"] for r in rows)
    r = raw(nbytes, -(-args.prompt // 16), args.concurrency, 20)
    log(f"raw Mooncake, {nbytes / 1e6:.2f} MB a request: {r['alone_ms']:.2f} ms alone (back to back), "
        f"{r['together_ms']:.2f} ms median a write with {args.concurrency} at once")
    print(f"\n| variant | concurrency | in service median of round means ms | min | raw ms (alone / {args.concurrency} "
          "at once) | in service / raw | TTFT p50 ms | other cores |")
    print("|---|---|---|---|---|---|---|---|")
    for v in variants:
        for c in (args.concurrency, 1):
            xs = [x for x in rows if x["variant"] == v and x["concurrency"] == c]
            med = statistics.median(x["transfer_ms"] for x in xs)
            floor = r["together_ms"] if c > 1 else r["alone_ms"]
            print(f"| {v} | {c} | {med:.2f} | {min(x['transfer_ms'] for x in xs):.2f} | {floor:.2f} | "
                  f"{med / floor:.2f}x | {statistics.median(x['ttft_p50_ms'] for x in xs):.0f} | "
                  f"{statistics.median(x['other_cores'] for x in xs):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
