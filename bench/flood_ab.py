"""Over-long floods on their own (issue 12 target: >= 5,000 rejections/s while admitted traffic slows by <= 5 %):
`python -m pdserve.bench.flood_ab [--repeats 3] [--seconds 3]` starts a tiny stack and measures, per flood kind
(gRPC token ids, gRPC text, HTTP text), the closed-loop rejection capacity with the gateway's CPU per rejection, then
admitted traffic alone vs under that flood paced at --rate, interleaved pairs. Writes bench/out/flood.{json,md}.

Every flood runs in its own process (flood.py); on a shared 2-core machine the flood client, the gateway and the
admitted traffic's four processes share the cores, so the report states the other load beside each figure."""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict

from .scenarios.plan import CONTEXT
from .harness.common import RESULTS, ROOT, ensure_model, log, under_flood
from .harness.stack import BenchStack, cpu_seconds, machine_cpu_seconds
from .harness.workload import fmt_ci, make_prompts, mean_ci

MAX_CHARS_PER_TOKEN = 9  # the tiny tokenizer's longest token


def kinds(stack: BenchStack) -> dict[str, list[str]]:
    text = ["--text-chars", str((CONTEXT + 1) * MAX_CHARS_PER_TOKEN)]  # at least CONTEXT + 1 tokens
    return {"gRPC token ids": ["--prompt-len", str(CONTEXT + 1)], "gRPC text": text,
            "HTTP text": text + ["--http", str(stack.procs["gateway"][0].http_port)]}


def flood_cmd(stack: BenchStack, args: list[str]) -> list[str]:
    return [sys.executable, "-u", "-m", "pdserve.bench.scenarios.flood", stack.gateway, *args]


def capacity(stack: BenchStack, args: list[str], seconds: float) -> dict:
    pids = stack.pids()
    cpu0 = {s: cpu_seconds(pid) for s, pid in pids.items()}
    m0, c0, t0 = machine_cpu_seconds(), _children_cpu(), time.perf_counter()
    out = subprocess.run(flood_cmd(stack, args) + ["--seconds", str(seconds), "--concurrency", "16"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120, stdin=subprocess.DEVNULL)
    dt = time.perf_counter() - t0
    res = json.loads([ln for ln in out.stdout.splitlines() if '"ready"' not in ln][-1])
    cpu = {s: cpu_seconds(pid) - cpu0[s] for s, pid in pids.items()}
    res["gateway_cpu_per_rejection"] = cpu["gateway"] / max(res["rejected"], 1)
    # busy cores beyond the stack, the flood client (start-up included) and this process: other users' work
    mine = sum(cpu.values()) + _children_cpu() - c0
    res["other_cores"] = max(0.0, machine_cpu_seconds() - m0 - mine) / dt
    return res


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def pair(stack: BenchStack, args: list[str], prompts, concurrency: int, rate: float) -> dict:
    alone, _ = stack.run("pdserve", "tiny", prompts, concurrency)
    (flooded, _), fl = under_flood(flood_cmd(stack, args) + ["--rate", str(rate), "--seconds", "120",
                                                              "--concurrency", "64", "--stop-on-stdin"],
                                   lambda: stack.run("pdserve+flood", "tiny", prompts, concurrency))
    return {"alone": asdict(alone), "flood": asdict(flooded), "flood_stats": fl}


def report(res: dict) -> str:
    L = ["# Over-long floods", "", f"`python -m pdserve.bench.flood_ab` ({res['when']}); admitted traffic: prompt "
         f"{res['cell']['prompt_len']} x concurrency {res['cell']['concurrency']}, {res['cell']['num_requests']} "
         f"requests; floods paced at {res['rate']:.0f}/s during it; {res['repeats']} interleaved pairs per kind. "
         "*Other cores*: cores busy with work outside the measured processes (other users of the machine).", "",
         "| flood | capacity rejections/s (16 clients) | gateway CPU µs / rejection | client CPU µs / request | "
         "other cores | rejections/s reached | admitted tok/s lost | admitted TTFT p50 higher |", "|---|---|---|---|---|---|---|---|"]
    for kind, r in res["kinds"].items():
        cap, pairs = r["capacity"], r["pairs"]
        lost = mean_ci([1 - p["flood"]["out_tok_s"] / p["alone"]["out_tok_s"] for p in pairs])
        ttft = mean_ci([p["flood"]["ttft_p50"] / p["alone"]["ttft_p50"] - 1 for p in pairs])
        reached = mean_ci([p["flood_stats"]["rejected_per_s"] for p in pairs])
        L.append(f"| {kind} ({cap['prompt']}) | {cap['rejected_per_s']:.0f} | "
                 f"{cap['gateway_cpu_per_rejection'] * 1e6:.0f} | {cap['client_cpu_s'] / max(cap['sent'], 1) * 1e6:.0f} | "
                 f"{cap['other_cores']:.2f} | {fmt_ci(*reached, digits=0)} | {fmt_ci(*lost, scale=100, unit=' %')} | "
                 f"{fmt_ci(*ttft, scale=100, unit=' %')} |")
    return "\n".join(L) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.flood_ab")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0, help="closed-loop capacity run per kind")
    p.add_argument("--rate", type=float, default=1000.0, help="paced flood during the admitted traffic, per second")
    p.add_argument("--out", default=os.path.join(RESULTS, "flood"))
    a = p.parse_args()
    stack = BenchStack(ensure_model("tiny"))
    try:
        cell = {"prompt_len": 128, "concurrency": 4, "num_requests": 16}
        prompts = make_prompts(cell["prompt_len"], cell["num_requests"], 512)
        stack.run("warm-up", "tiny", prompts[:4], 4)
        res = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cell": cell, "rate": a.rate,
               "repeats": a.repeats, "kinds": {}}
        for kind, args in kinds(stack).items():
            cap = capacity(stack, args, a.seconds)
            log(f"{kind}: {cap['rejected_per_s']:.0f} rejections/s, gateway {cap['gateway_cpu_per_rejection'] * 1e6:.0f} "
                f"µs CPU each, codes {cap['codes']}, other cores {cap['other_cores']:.2f}")
            pairs = [pair(stack, args, prompts, cell["concurrency"], a.rate) for _ in range(a.repeats)]
            for q in pairs:
                log(f"  alone {q['alone']['out_tok_s']:.0f} tok/s | flooded {q['flood']['out_tok_s']:.0f} tok/s, "
                    f"{q['flood_stats']['rejected_per_s']:.0f} rejections/s {q['flood_stats']['codes']}")
            res["kinds"][kind] = {"capacity": cap, "pairs": pairs}
    finally:
        stack.close()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(report(res))
    print(report(res))


if __name__ == "__main__":
    main()
