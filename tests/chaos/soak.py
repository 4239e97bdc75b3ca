"""`make soak`: minutes at saturation with faults on; reports requests served, violations caught,
pages leaked (must be 0), undetected corruptions (must be 0) and each service's memory growth.

By default the broker runs as two replicas electing a leader on a 3-member etcd (docs/design.md §3, "Leader
failover"), and every --failover-every seconds the leader is killed (and started again as a standby) or paused
past its etcd lease, in turn as --failovers lists them. Per failover it reports how long after it a new request
was answered (probes of one token, sent every 0.1 s from the fault on), and at the end the leader changes the
brokers counted: with --failover-every 0 this is the check that a loaded machine keeps its leader (must be 0).

Not part of `make test`. Usage: python -m tests.chaos.soak [--minutes 10] [--concurrency 24] [--seed 0]
[--brokers 2] [--failover-every 60] [--failovers kill,pause]
"""
from __future__ import annotations

import argparse
import math
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from tests.chaos.conftest import CHAOS_EXTRA
from tests.chaos.test_schedules import FAULT_ARGS, FAULTS, OTHER_FAULTS, run_request
from tests.chaos.test_schedules_ha import TTL, ha_extra, leader_index
from tests.integration.helpers import drained
from tests.integration.stack import Stack
from tests.oracle import Oracle, OracleMismatch

# memory a process takes while its bounded caches (the prefix route maps, torch's allocator pools) fill
WARM_UP_MINUTES = 2
ENGINES = ("prefill", "decode")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:  # a broker replica killed a moment ago, not yet started again
        pass
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


def route_entries(stack: Stack) -> dict[str, float]:
    """Entries of the gateway's bounded prefix route maps, by role: they fill during the warm-up, then stay."""
    return {role: stack.metric("gateway", "pdserve_gateway_prefix_route_entries", {"role": role})
            for role in ("prefill", "decode")}


def heap_free_mib(stack: Stack, service: str, index: int) -> float:
    """The free C heap an engine process keeps for its next forward pass (services/engine/heap.py); NaN where the
    process does not say (jemalloc's heap, services/engine/allocator.py)."""
    try:
        return stack.metric(service, "pdserve_c_heap_bytes", {"state": "free"}, index=index) / 2 ** 20
    except (OSError, KeyError):
        return float("nan")


def violations(stack: Stack) -> float:
    total = 0.0
    for svc in ("decode", "prefill", "broker"):
        for i in range(len(stack.procs[svc])):
            total += stack.metric(svc, "pdserve_lease_violations_total", index=i)
    return total


def terms_won(stack: Stack) -> float:
    """Terms won by the replicas alive now (a killed replica's count goes with it)."""
    total = 0.0
    for i in range(len(stack.procs["broker"])):
        try:
            total += stack.metric("broker", "pdserve_broker_terms_won_total", index=i)
        except OSError:
            pass  # paused or restarting
    return total


def free_set_writes(stack: Stack, index: int) -> float:
    """The etcd writes of durable free sets by one replica (each one round trip)."""
    try:
        return stack.metric("broker", "pdserve_broker_free_set_writes_total", index=index)
    except (OSError, KeyError):
        return 0.0


class Failover:
    """One leader kill or pause: when it began, and when the first probe sent after it was answered."""

    def __init__(self, what: str, replica: int) -> None:
        self.what, self.replica = what, replica
        self.at = time.monotonic()
        self.answered: float | None = None
        self.refusals: Counter = Counter()
        self.free_set_writes = 0.0

    def probe(self, stack: Stack, until: float) -> None:
        """One-token requests every 0.1 s, each on its own thread, until one is answered or `until` passes."""
        lock = threading.Lock()

        def one(n: int) -> None:
            outcome = run_request(stack, "probe", [5 + n % 400, 7, 9], 1, None)
            with lock:
                if outcome.err is None:
                    self.answered = min(self.answered or outcome.end, outcome.end)
                else:
                    self.refusals[outcome.err[:2]] += 1
        threads = []
        n = 0
        while self.answered is None and time.monotonic() < until:
            threads.append(threading.Thread(target=one, args=(n,), daemon=True))
            threads[-1].start()
            n += 1
            time.sleep(0.1)
        for t in threads:
            t.join(60)

    def line(self) -> str:
        took = "never" if self.answered is None else f"{self.answered - self.at:.2f}s"
        what = "no failover (a control)" if self.what == "none" else f"{self.what} of replica {self.replica}"
        return f"{what}: a new request answered after {took}; probes refused {dict(self.refusals)}"


def fail_over(stack: Stack, what: str) -> Failover:
    """Kills the leader (started again as a standby) or pauses it past its etcd lease, and probes meanwhile; "none":
    probes alone, the same client's view with no failover (on a saturated stack a new request waits for pages)."""
    i = leader_index(stack)
    f = Failover(what, i)
    prober = threading.Thread(target=f.probe, args=(stack, f.at + 30), daemon=True)
    if what == "kill":
        f.free_set_writes = free_set_writes(stack, i)  # its count goes with it
        os.killpg(stack.procs["broker"][i].popen.pid, signal.SIGKILL)
        f.at = time.monotonic()
        prober.start()
        stack.restart("broker", i)
    elif what == "pause":
        proc = stack.procs["broker"][i]
        os.killpg(proc.popen.pid, signal.SIGSTOP)
        f.at = time.monotonic()
        prober.start()
        time.sleep(TTL + 1.0)
        os.killpg(proc.popen.pid, signal.SIGCONT)
    else:
        prober.start()
    prober.join()
    return f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--brokers", type=int, default=2, help="1: one broker, no etcd")
    ap.add_argument("--failover-every", type=float, default=60.0, help="seconds; 0: none (the leader must hold)")
    ap.add_argument("--failovers", default="kill,pause", help="what each failover does to the leader, in turn")
    ap.add_argument("--route-entries", type=int, default=8192,
                    help="the gateway's --prefix-route-entries: small enough that its maps fill, the gateway's "
                         "warm-up, within the first minutes (at the default 65,536 they take ~17 MiB and, with every "
                         "prompt distinct, most of a 10-minute run)")
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "pdserve-tiny"))
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    ha = args.brokers > 1
    kinds = [k for k in args.failovers.split(",") if k]
    if ha and args.failover_every and not set(kinds) <= {"kill", "pause"}:
        ap.error(f"--failovers {args.failovers!r}: each one kill or pause")
    print(f"soak: {args.minutes} min, concurrency {args.concurrency}, seed {args.seed}, "
          + (f"{args.brokers} broker replicas on 3 etcd members (election ttl {TTL}s), "
             + (f"a failover every {args.failover_every:.0f}s ({args.failovers})" if args.failover_every
                else "no failover") if ha else "one broker"), flush=True)
    etcd = None
    if ha:
        from pdserve.common.etcd_server import EtcdCluster
        etcd = EtcdCluster(Path(tempfile.mkdtemp(prefix="pdserve-soak-etcd-")), 3)
        etcd.start()
    try:
        return soak(args, rng, ha, kinds, etcd)
    finally:
        if etcd is not None:
            etcd.stop()


def soak(args, rng: random.Random, ha: bool, kinds: list[str], etcd) -> int:
    extra = {**(ha_extra() if ha else CHAOS_EXTRA), "gateway": ["--prefix-route-entries", str(args.route_entries)]}
    stack = Stack(args.model, num_prefill=2, prefill_pool_tokens=2048, decode_pool_tokens=4096, allow_small=True,
                  extra=extra,
                  **({"brokers": args.brokers, "etcd": ",".join(etcd.endpoints)} if ha else {}))
    oracle = Oracle(args.model)
    failovers: list[Failover] = []
    restarted: Counter = Counter()
    outcomes: Counter = Counter()
    corrupt = []
    lock = threading.Lock()
    try:
        rss0 = {p.name: rss_mib(p.popen.pid) for ps in stack.procs.values() for p in ps}
        v0 = violations(stack)
        started = time.monotonic()
        rss_series: dict[str, list[tuple[float, float]]] = {name: [(0.0, v)] for name, v in rss0.items()}
        kept_series: dict[str, list[tuple[float, float]]] = {}  # engine processes: the free C heap they keep
        next_sample = started + 60
        deadline = time.monotonic() + args.minutes * 60
        next_fault = time.monotonic() + 2
        next_report = time.monotonic() + 30
        # a failover, then half way to the next one the same probes with none (a control), and so on
        next_failover = time.monotonic() + args.failover_every / 2 if ha and args.failover_every else float("inf")
        terms0 = terms_won(stack) if ha else 0.0
        failing_over = None

        def record(f: Failover) -> None:
            failovers.append(f)
            restarted[stack.procs["broker"][f.replica].name] += f.what == "kill"
            print(f"  {f.line()}", flush=True)

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

        # the failovers on a thread of their own: the load's pool is always full
        with ThreadPoolExecutor(args.concurrency) as pool, ThreadPoolExecutor(1) as failer:
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
                    try:
                        index = rng.randrange(2) if service == "prefill" else \
                            leader_index(stack) if service == "broker" and ha else 0
                        stack.arm(service, name, arg=FAULT_ARGS.get(name, "1"), index=index)
                    except grpc.RpcError:
                        pass  # a broker replica being restarted or paused: the fault is simply not armed
                    next_fault = now + rng.uniform(0.5, 3)
                if now > next_failover and (failing_over is None or failing_over.done()):
                    if failing_over is not None:
                        record(failing_over.result())
                    faults_done = sum(f.what != "none" for f in failovers)
                    what = kinds[faults_done % len(kinds)] if len(failovers) % 2 == 0 else "none"
                    failing_over = failer.submit(fail_over, stack, what) if now + 30 < deadline else None
                    next_failover = now + args.failover_every / 2
                if now > next_sample:  # every minute, so a slow leak shows as a slope, not as noise
                    minute = (now - started) / 60
                    for svc, ps in stack.procs.items():
                        for i, p in enumerate(ps):
                            rss_series[p.name].append((minute, rss_mib(p.popen.pid)))
                            if svc in ENGINES and not math.isnan(kept := heap_free_mib(stack, svc, i)):
                                kept_series.setdefault(p.name, []).append((minute, kept))
                    print("  RSS MiB at minute %.0f: %s; of it free C heap kept for the next pass: %s; the gateway's "
                          "prefix route maps hold %s entries"
                          % (minute, {k: round(v[-1][1]) for k, v in rss_series.items()},
                             {k: round(v[-1][1]) for k, v in kept_series.items()}, route_entries(stack)), flush=True)
                    next_sample = now + 60
                if now > next_report:
                    with lock:
                        print(f"  {sum(outcomes.values())} requests: {dict(outcomes)}", flush=True)
                    next_report = now + 30
                time.sleep(0.05)
            if failing_over is not None:
                record(failing_over.result())
        leader_changes = terms_won(stack) - terms0 if ha else 0.0
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
            if restarted[name]:  # a new process each time: its series is not one process's memory
                print(f"  {name}: killed and started again {restarted[name]} times; RSS now {rss1[name]:.0f} MiB")
                continue
            after = [(t, v) for t, v in rss_series[name] if t >= WARM_UP_MINUTES]
            print(f"  {name}: RSS {rss0[name]:.0f} MiB -> {rss1[name]:.0f} MiB ({rss1[name] - rss0[name]:+.0f}); "
                  f"slope after minute {WARM_UP_MINUTES} {slope_per_min(after):+.2f} MiB/min over {len(after)} "
                  f"samples; all samples {[round(v) for _, v in rss_series[name]]}")
            if len(kept_series.get(name, ())) == len(rss_series[name]) - 1:  # glibc's heap: RSS less its free part
                net = [(t, v - k) for (t, v), (_, k) in zip(rss_series[name][1:], kept_series[name])]
                net_after = [(t, v) for t, v in net if t >= WARM_UP_MINUTES]
                print(f"    less the free C heap it keeps ({[round(k) for _, k in kept_series[name]]} MiB): slope "
                      f"after minute {WARM_UP_MINUTES} {slope_per_min(net_after):+.2f} MiB/min; samples "
                      f"{[round(v) for _, v in net]}")
        dead = [p.name for ps in stack.procs.values() for p in ps if not p.alive()]
        print(f"  crashed services: {dead or 'none'}")
        unanswered = [f for f in failovers if f.answered is None]
        if ha and args.failover_every:
            def took(what: str) -> list[float]:
                return sorted(round(f.answered - f.at, 2) for f in failovers if f.what == what and f.answered)
            kills, pauses, controls = took("kill"), took("pause"), took("none")
            print(f"  failovers: {sum(f.what != 'none' for f in failovers)} ({len(unanswered)} probes unanswered "
                  f"within 30 s); decode hand-overs {stack.metric('decode', 'pdserve_decode_handovers_total'):.0f}")
            print(f"  a new request answered after a kill: {kills} s (worst {max(kills, default=float('nan'))}); "
                  f"after a pause: {pauses} s; with no failover (controls): {controls} s; etcd lease ttl {TTL}s")
        elif ha:
            print(f"  leader changes with no fault injected: {leader_changes:.0f} (must be 0)")
        if ha:
            writes = sum(f.free_set_writes for f in failovers) + sum(
                free_set_writes(stack, i) for i in range(len(stack.procs["broker"])))
            print(f"  etcd writes of durable free sets: {writes:.0f}, "
                  f"{writes / max(1, sum(outcomes.values())):.4f} per request")
        return 1 if leaked or corrupt or dead or unanswered or (ha and not args.failover_every and leader_changes) \
            else 0
    finally:
        stack.close()


if __name__ == "__main__":
    sys.exit(main())
