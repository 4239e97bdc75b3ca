"""`make kills`: the leader-kill acceptance of docs/design.md §3 ("Leader failover"), measured at its load and not
in make test (about 5 minutes).

Two broker replicas on a 3-member etcd (election ttl 2 s), a stack of the default shape and pools. Sixteen streams
of 400 tokens run at all times, each on one of four shared prefixes (every stream that ends is followed by a new
one, so new requests keep arriving); once they run, the leading replica is killed with SIGKILL (and started again
as a standby) every --every seconds, --kills times. Per kill: when a new term led (the standby's, or the killed
replica's started again, whichever won) and when a new request (probes
of one token every 0.1 s from the kill on) was answered. At the end: every stream that was decoding at a kill
must have completed every token with the oracle's ids, the worst kill's admission within ttl + 1 s, 0 lease
violations, and every pool drained to 0 leased pages. A stream still waiting for its prompt at a kill may end
UNAVAILABLE BROKER_FAILOVER (retryable, no token): counted, not a failure.

Usage: python -m tests.chaos.kills [--kills 10] [--every 15] [--streams 16] [--tokens 400]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from tests.chaos.soak import ROOT, fail_over, violations
from tests.chaos.test_schedules import run_request
from tests.chaos.test_schedules_ha import TTL, ha_extra, leader_index
from tests.integration.helpers import drained, wait_for
from tests.integration.stack import Stack
from tests.oracle import Oracle, OracleMismatch

PREFIXES, PREFIX_TOKENS = 4, 128


def term(stack: Stack, index: int) -> float:
    """The term the replica leads in, or 0 if it does not lead (or does not answer)."""
    try:
        if stack.metric("broker", "pdserve_broker_leader", index=index) == 1:
            return stack.metric("broker", "pdserve_broker_term", index=index)
    except (OSError, KeyError):  # killed, or started again and not yet exporting
        pass
    return 0.0


def led_at(stack: Stack, old_term: float, limit: float) -> float | None:
    """When (monotonic) a replica leads in a term newer than old_term (the standby, or the killed one started
    again: whichever wins the election), or None within `limit` seconds."""
    until = time.monotonic() + limit
    while time.monotonic() < until:
        if any(term(stack, i) > old_term for i in range(len(stack.procs["broker"]))):
            return time.monotonic()
        time.sleep(0.05)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--every", type=float, default=15.0, help="seconds between kills")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "pdserve-tiny"))
    args = ap.parse_args(argv)
    from pdserve.common.etcd_server import EtcdCluster
    etcd = EtcdCluster(Path(tempfile.mkdtemp(prefix="pdserve-kills-etcd-")), 3)
    etcd.start()
    try:
        return run(args, etcd)
    finally:
        etcd.stop()


def run(args, etcd) -> int:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(2, 512) for _ in range(PREFIX_TOKENS)] for _ in range(PREFIXES)]
    stack = Stack(args.model, extra=ha_extra(), brokers=2, etcd=",".join(etcd.endpoints))
    oracle = Oracle(args.model)
    lock = threading.Lock()
    outcomes: Counter = Counter()
    failed, corrupt, spans = [], [], []  # spans: (start, first token seen, end) of each stream that completed
    stop = threading.Event()
    print(f"kills: {args.kills} kill -9s of the leader, one every {args.every:.0f}s, under {args.streams} streams "
          f"of {args.tokens} tokens on {PREFIXES} shared prefixes of {PREFIX_TOKENS} tokens; election ttl {TTL}s",
          flush=True)

    def streams(worker: int) -> None:
        r = random.Random(args.seed * 1000 + worker)
        while not stop.is_set():
            prompt = prefixes[r.randrange(PREFIXES)] + [r.randrange(2, 512) for _ in range(r.randrange(8, 96))]
            tokens: list[int] = []
            outcome = run_request(stack, "stream", prompt, args.tokens, None, tokens)
            with lock:
                if outcome.err is None:
                    outcomes["OK"] += 1
                    spans.append((outcome.start, outcome.end))
                    try:
                        oracle.check(prompt, outcome.tokens, use_hf=False)
                    except OracleMismatch as e:
                        corrupt.append(str(e))
                elif not tokens and outcome.err[:2] == ("UNAVAILABLE", "BROKER_FAILOVER"):
                    outcomes["refused before decoding (BROKER_FAILOVER)"] += 1
                else:
                    outcomes[":".join(outcome.err[:2])] += 1
                    failed.append((len(tokens), outcome.err, outcome.start, outcome.end))

    try:
        workers = [threading.Thread(target=streams, args=(i,), daemon=True) for i in range(args.streams)]
        for w in workers:
            w.start()
        wait_for(lambda: stack.metric("decode", "pdserve_requests_running") >= args.streams, 60,
                 f"{args.streams} streams decoding")
        kills = []
        for k in range(args.kills):
            time.sleep(args.every)
            running = stack.metric("decode", "pdserve_requests_running")
            killed = leader_index(stack)
            old_term = term(stack, killed)
            box: list = []
            t = threading.Thread(target=lambda: box.append(fail_over(stack, "kill")))
            t.start()
            led = led_at(stack, old_term, 30)
            t.join()
            f = box[0]
            led = None if led is None else led - f.at
            kills.append((f, led))
            took = "never" if f.answered is None else f"{f.answered - f.at:.2f}s"
            print(f"  kill {k + 1} of replica {killed} with {running:.0f} streams decoding: a new term led after "
                  f"{'never' if led is None else f'{led:.2f}s'}, a new request answered after {took}; "
                  f"probes refused {dict(f.refusals)}", flush=True)
        stop.set()
        for w in workers:
            w.join(120)
        t0 = time.monotonic()
        while not drained(stack) and time.monotonic() - t0 < 60:
            time.sleep(0.2)
        states = stack.pool_states()
        leaked = sum(s.num_leased + s.num_quarantined for s in states)
        caught = violations(stack)
        answered = [f.answered - f.at for f, _ in kills if f.answered is not None]
        worst = max(answered, default=float("inf")) if len(answered) == len(kills) else float("inf")
        through = sum(1 for s, e in spans if any(s < f.at < e for f, _ in kills))
        print("\nkills report")
        print(f"  streams: {sum(outcomes.values())} {dict(outcomes)}; {through} completed through a kill")
        print(f"  streams that failed after decoding began: {len(failed)} {failed[:3]}")
        print(f"  oracle mismatches: {len(corrupt)} {corrupt[:3]}")
        print(f"  a new request answered after each kill: {sorted(round(a, 2) for a in answered)} s "
              f"(worst {worst:.2f}s; bound ttl + 1 = {TTL + 1}s)")
        print(f"  a new term led after: {sorted(round(l, 2) for _, l in kills if l is not None)} s")
        print(f"  lease violations: {caught:.0f}; pages leased or quarantined after the drain: {leaked}")
        dead = [p.name for ps in stack.procs.values() for p in ps if not p.alive()]
        print(f"  crashed services: {dead or 'none'}")
        return 1 if failed or corrupt or leaked or caught or dead or worst > TTL + 1 else 0
    finally:
        stop.set()
        stack.close()


if __name__ == "__main__":
    sys.exit(main())
