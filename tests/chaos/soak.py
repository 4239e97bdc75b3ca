"""`make soak`: minutes at saturation with faults on; reports requests served, violations caught,
pages leaked (must be 0), undetected corruptions (must be 0) and each service's memory growth.

Not part of `make test`. Usage: python -m tests.chaos.soak [--minutes 10] [--concurrency 24] [--seed 0]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from tests.chaos.conftest import CHAOS_EXTRA
from tests.chaos.test_schedules import FAULT_ARGS, FAULTS, OTHER_FAULTS, run_request
from tests.integration.helpers import drained
from tests.integration.stack import Stack
from tests.oracle import Oracle, OracleMismatch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def slope_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (minute, MiB) samples: a slow leak shows as a steady positive slope."""
    if len(samples) < 2:
        return float("nan")
    n = len(samples)
    mx = sum(t for t, _ in samples) / n
    my = sum(v for _, v in samples) / n
    var = sum((t - mx) ** 2 for t, _ in samples)
    return sum((t - mx) * (v - my) for t, v in samples) / var if var else float("nan")


def violations(stack: Stack) -> float:
    total = 0.0
    for svc in ("decode", "prefill", "broker"):
        for i in range(len(stack.procs[svc])):
            total += stack.metric(svc, "pdserve_lease_violations_total", index=i)
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "pdserve-tiny"))
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    print(f"soak: {args.minutes} min, concurrency {args.concurrency}, seed {args.seed}", flush=True)
    stack = Stack(args.model, num_prefill=2, prefill_pool_tokens=2048, decode_pool_tokens=4096, allow_small=True,
                  extra=CHAOS_EXTRA)
    oracle = Oracle(args.model)
    outcomes: Counter = Counter()
    corrupt = []
    lock = threading.Lock()
    try:
        rss0 = {p.name: rss_mib(p.popen.pid) for ps in stack.procs.values() for p in ps}
        v0 = violations(stack)
        started = time.monotonic()
        rss_series: dict[str, list[tuple[float, float]]] = {name: [(0.0, v)] for name, v in rss0.items()}
        next_sample = started + 60
        deadline = time.monotonic() + args.minutes * 60
        next_fault = time.monotonic() + 2
        next_report = time.monotonic() + 30

        def one(job_seed: int):
            r = random.Random(job_seed)
            prompt = [r.randrange(2, 512) for _ in range(r.randrange(1, 400))]
            cancel = r.uniform(0, 0.5) if r.random() < 0.1 else None
            outcome = run_request(stack, "normal", prompt, r.randrange(1, 16), cancel)
            tokens, err = outcome.tokens, outcome.err
            try:
                if tokens:
                    oracle.check(prompt, tokens, use_hf=False)
            except OracleMismatch as e:
                with lock:
                    corrupt.append((job_seed, str(e)))
            with lock:
                outcomes["OK" if err is None else err[0]] += 1

        with ThreadPoolExecutor(args.concurrency) as pool:
            pending = set()
            n = 0
            while time.monotonic() < deadline:
                pending = {f for f in pending if not f.done()}
                while len(pending) < args.concurrency * 2:
                    pending.add(pool.submit(one, args.seed * 10_000_000 + n))
                    n += 1
                now = time.monotonic()
                if now > next_fault:
                    service, name = rng.choice([("prefill", f) for f in FAULTS] + OTHER_FAULTS)
                    index = rng.randrange(2) if service == "prefill" else 0
                    stack.arm(service, name, arg=FAULT_ARGS.get(name, "1"), index=index)
                    next_fault = now + rng.uniform(0.5, 3)
                if now > next_sample:  # every minute, so a slow leak shows as a slope, not as noise
                    minute = (now - started) / 60
                    for ps in stack.procs.values():
                        for p in ps:
                            rss_series[p.name].append((minute, rss_mib(p.popen.pid)))
                    print("  RSS MiB at minute %.0f: %s" % (minute, {k: round(v[-1][1]) for k, v in
                                                                   rss_series.items()}), flush=True)
                    next_sample = now + 60
                if now > next_report:
                    with lock:
                        print(f"  {sum(outcomes.values())} requests: {dict(outcomes)}", flush=True)
                    next_report = now + 30
                time.sleep(0.05)
        stack.clear_faults()
        t = time.monotonic()
        while not drained(stack) and time.monotonic() - t < 60:
            time.sleep(0.2)
        states = stack.pool_states()
        leaked = sum(s.num_leased + s.num_quarantined for s in states)
        rss1 = {p.name: rss_mib(p.popen.pid) for ps in stack.procs.values() for p in ps}
        caught = violations(stack) - v0
        print("\nsoak report")
        print(f"  requests: {sum(outcomes.values())} {dict(outcomes)}")
        print(f"  violations caught: {caught:.0f}")
        print(f"  undetected corruptions: {len(corrupt)} {corrupt[:3]}")
        print(f"  pages leaked after quiescence: {leaked} ({states})".replace("\n", " "))
        for name in rss0:
            print(f"  {name}: RSS {rss0[name]:.0f} MiB -> {rss1[name]:.0f} MiB ({rss1[name] - rss0[name]:+.0f}); "
                  f"slope {slope_per_min(rss_series[name]):+.2f} MiB/min over {len(rss_series[name])} samples "
                  f"{[round(v) for _, v in rss_series[name]]}")
        dead = [p.name for ps in stack.procs.values() for p in ps if not p.alive()]
        print(f"  crashed services: {dead or 'none'}")
        return 1 if leaked or corrupt or dead else 0
    finally:
        stack.close()


if __name__ == "__main__":
    sys.exit(main())
