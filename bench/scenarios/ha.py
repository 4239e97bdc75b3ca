"""`python -m pdserve.bench.scenarios.ha [--rounds 5] [--requests 64] [--concurrency 8] [--prompt 256]`: broker
replicas on etcd against one broker, side by side (issue 29).

Two stacks of the same checkpoint run at once, one with a single broker, one with two replicas electing a leader on
a local etcd (as `pdserve up --ha`); the same seeded prompts go to each in turn, round after round, the order
alternating, so a slower minute of the machine falls on both. Prints, per system, the median over the rounds of
output tok/s and TTFT p50 with their spread (min-max), the median of each round's ratio HA / single with its spread
(targets: tok/s within 2 %, TTFT p50 within 2 % or 1 ms), and the etcd round trips the HA stack paid per request (durable free set writes; the leader's
lease renewals are per second, not per request). Writes bench/out/ha.json and ha.md."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile

from pdserve import launcher

from ..harness.common import RESULTS, ensure_model, log
from ..harness.pdclient import run_load, scrape
from ..harness.workload import make_prompts, summarize

SYSTEMS = ("single", "ha")


def free_set_writes(procs) -> float:
    """Every etcd write of durable free sets so far, over the broker replicas (a restarted one counts from 0)."""
    total = 0.0
    for p in procs["broker"]:
        total += sum(v for (name, _), v in scrape(p.metrics_port).items()
                     if name == "pdserve_broker_free_set_writes_total")
    return total


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="checkpoint directory (default: the tiny preset)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    args.model = args.model or ensure_model("tiny")
    from pdserve.common.etcd_server import EtcdCluster
    work = tempfile.mkdtemp(prefix="pdserve-bench-ha-")
    etcd = EtcdCluster(os.path.join(work, "etcd"), 1)
    stacks: dict[str, dict] = {}
    try:
        etcd.start()
        env = {"GLOG_minloglevel": "2"}
        stacks["single"] = launcher.start_stack(args.model, log_dir=os.path.join(work, "single"), env=env)
        stacks["ha"] = launcher.start_stack(args.model, log_dir=os.path.join(work, "ha"), env=env, brokers=2,
                                            etcd=etcd.endpoints[0],
                                            extra={"broker": ["--election-ttl", "3"], "decode": ["--max-blind", "5"]})
        prompts = make_prompts(args.prompt, args.requests, 512, seed=29)
        for name, procs in stacks.items():  # warm-up: compiled kernels, pages parked in etcd
            run_load(procs["gateway"][0].target, prompts[:args.concurrency], args.concurrency, args.max_tokens)
        rows: dict[str, list] = {s: [] for s in SYSTEMS}
        writes0 = free_set_writes(stacks["ha"])
        for r in range(args.rounds):
            for name in (SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]):
                records, wall = run_load(stacks[name]["gateway"][0].target, prompts, args.concurrency,
                                         args.max_tokens)
                s = summarize(name, "tiny", args.prompt, args.concurrency, records, wall)
                rows[name].append({"out_tok_s": s.out_tok_s, "ttft_p50": s.ttft_p50, "errors": s.num_errors})
                log(f"round {r + 1}/{args.rounds} {name}: {s.out_tok_s:.0f} tok/s, TTFT p50 "
                    f"{s.ttft_p50 * 1e3:.1f} ms, {s.num_errors} errors")
        per_request = (free_set_writes(stacks["ha"]) - writes0) / (args.rounds * args.requests)
    finally:
        for procs in stacks.values():
            launcher.stop_stack(procs)
        etcd.stop()
        shutil.rmtree(work, ignore_errors=True)

    def med(name: str, key: str) -> tuple[float, float, float]:
        xs = [row[key] for row in rows[name]]
        return statistics.median(xs), min(xs), max(xs)
    out = {"args": vars(args), "rounds": rows, "etcd_writes_per_request": per_request}
    lines = [f"# Broker replicas on etcd against one broker ({args.rounds} interleaved rounds of {args.requests} "
             f"requests, prompt {args.prompt}, {args.max_tokens} tokens out, concurrency {args.concurrency})", "",
             "| system | output tok/s, median (min-max) | TTFT p50 ms, median (min-max) | errors |",
             "| --- | --- | --- | --- |"]
    for name in SYSTEMS:
        t, t0, t1 = med(name, "out_tok_s")
        f, f0, f1 = med(name, "ttft_p50")
        lines.append(f"| {name} | {t:.1f} ({t0:.1f}-{t1:.1f}) | {f * 1e3:.2f} ({f0 * 1e3:.2f}-{f1 * 1e3:.2f}) | "
                     f"{sum(row['errors'] for row in rows[name])} |")
    # each round's ratio of two runs a few seconds apart: a slower minute of the machine cancels out of it, where
    # it would not out of the ratio of two medians taken over the whole run
    def paired(key: str, f) -> tuple[float, float, float]:
        xs = [f(h[key], s[key]) for h, s in zip(rows["ha"], rows["single"])]
        return statistics.median(xs), min(xs), max(xs)
    tok = paired("out_tok_s", lambda h, s: h / s)
    ttft_ratio = paired("ttft_p50", lambda h, s: h / s)
    ttft_diff_ms = paired("ttft_p50", lambda h, s: (h - s) * 1e3)
    out.update(tok_s_ratio=tok[0], ttft_p50_ratio=ttft_ratio[0], ttft_p50_diff_ms=ttft_diff_ms[0],
               paired_spread={"tok_s_ratio": tok[1:], "ttft_p50_ratio": ttft_ratio[1:],
                              "ttft_p50_diff_ms": ttft_diff_ms[1:]})
    lines += ["", f"HA / single, the median of the {args.rounds} rounds' paired ratios (min-max): output tok/s "
                  f"{tok[0]:.3f}x ({tok[1]:.3f}-{tok[2]:.3f}; target within 2 %: "
                  f"{'met' if abs(tok[0] - 1) <= 0.02 else 'missed'}), TTFT p50 {ttft_ratio[0]:.3f}x "
                  f"({ttft_ratio[1]:.3f}-{ttft_ratio[2]:.3f}), {ttft_diff_ms[0]:+.2f} ms (target within 2 % or 1 ms: "
                  f"{'met' if abs(ttft_ratio[0] - 1) <= 0.02 or abs(ttft_diff_ms[0]) <= 1 else 'missed'}); etcd "
                  f"round trips per request (durable free set writes): {per_request:.3f}"]
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "ha.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(RESULTS, "ha.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return out


if __name__ == "__main__":
    main()
