"""Seeded chaos schedules (issue 3): mixed load with faults while service processes are killed, paused
and restarted. Each schedule prints its seed; PDSERVE_CHAOS_SEED=N replays schedule N alone.

After each schedule: every success passes the reference oracle; every failure is typed, and the
tokens it streamed before failing pass the oracle too (nothing after a violation is mixed in);
no verified page carried a freed page's canary marker; no page is leased, quarantine drains; and no
service died that the schedule did not kill. And every DATA_LOSS a client saw and every lease violation a
service counted is attributed to a cause on that same request (attribution.py): the schedule prints
`attributed N / unexplained M` and fails on any unexplained one, a false alarm.

Two disruptions cut decode's link to the broker while streams that read shared prefix pages run: cut_watch (the
broker ends the revocation stream) and reset_broker (every TCP connection to the broker's port reset, `ss -K`).
Decode reconnects and re-checks every running request's leases; nothing there is wrong, so nothing may fail.
"""
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.client import build_request
from pdserve.common.errors import from_rpc_error
from tests.chaos.attribution import Outcome, Record, Window
from tests.chaos.hostile import REFUSED, hostile_calls
from tests.integration.helpers import drained, generate_when_served, reset_connections, wait_for

NUM_SCHEDULES = 20
REQUESTS_PER_SCHEDULE = 100
FAULTS = ["prefill.short_transfer", "prefill.skip_page", "prefill.bit_flip", "prefill.skip_tags",
          "prefill.lose_end_write", "prefill.delay_before_write", "transfer.fail_then_land", "prefill.slow_transfer"]
# a late write after a reported failure lands 0.2-5 s later (just under chaos prefill's landing bound of ~5.3 s);
# a slow transfer outlives prefill's 2 s transfer timeout
FAULT_ARGS = {"prefill.delay_before_write": "1500", "transfer.fail_then_land": "5000", "prefill.slow_transfer": "3000"}
# faults armed on the broker or decode: a Grant whose reply is lost, a Release that fails (both reclaimed by the
# broker's reconciliation), a revocation stream cut (decode resumes from its cursor and re-checks its leases)
OTHER_FAULTS = [("broker", "broker.lose_grant_reply"), ("decode", "decode.fail_release"), ("broker", "broker.cut_watch"),
                ("decode", "decode.corrupt_cached")]
# a third of the prompts start with one 48-token (3-page) prefix of the schedule: the prefix cache serves them, and
# decode.corrupt_cached corrupts a cached page in place (a miss and a recompute, never output)
SHARED_PREFIX, SHARED_SHARE = 48, 0.35
CORRUPTIONS = ["bit_flip", "foreign_tag", "stale_generation", "late_write"]
DISRUPTIONS = ["kill_prefill", "pause_prefill", "pause_decode", "kill_broker", "pause_broker", "none", "hostile",
               "cut_watch", "reset_broker"]
# the disruptions that cut decode's link to the broker run these streams too, on the schedule's shared prefix, and
# cut it while they stream: decode re-checks each, its shared pages and the one it published included. At their
# longest they hold 4 x 29 of the chaos pool's 128 pages; pages come on demand and a dry pool preempts (the
# gateway resubmits), so the rest of the load still runs
LINK_CUTS = {"cut_watch", "reset_broker"}
LONG_STREAMS, LONG_TOKENS, LONG_SUFFIX = 4, 400, 16
TYPED = {"DATA_LOSS", "UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "RESOURCE_EXHAUSTED"}
SEEDS = [int(os.environ["PDSERVE_CHAOS_SEED"])] if os.environ.get("PDSERVE_CHAOS_SEED") else range(NUM_SCHEDULES)


def run_request(stack, kind: str, prompt: list[int], max_tokens: int, cancel_after: float | None,
                tokens: list[int] | None = None) -> Outcome:
    """tokens: a list to stream into, for a caller that watches the progress."""
    start = time.monotonic()
    call = stack.gateway.Generate(build_request(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True),
                                  timeout=60)
    if cancel_after is not None:
        threading.Timer(cancel_after, call.cancel).start()
    tokens = [] if tokens is None else tokens
    request_id = b""
    try:
        for r in call:
            request_id = request_id or r.request_id
            tokens.extend(r.token_ids)
    except grpc.RpcError as e:
        err = from_rpc_error(e)
        # the submission that failed, as the gateway names it (a retry or a resubmission has its own id)
        failed = bytes.fromhex(err.metadata.get("request_id", ""))
        return Outcome(kind, prompt, tokens, (err.code.name, err.reason, err.message), failed or request_id,
                       err.metadata.get("prefill", ""), start, time.monotonic())
    return Outcome(kind, prompt, tokens, None, request_id, "", start, time.monotonic())


def rechecks(stack) -> dict[str, float]:
    return {o: stack.metric("decode", "pdserve_lease_rechecks_total", {"outcome": o})
            for o in ("current", "not_current", "unreachable", "released")}


class Long:
    """A long stream the test watches: its tokens as they come, and whether it ended."""

    def __init__(self, stack, prompt: list[int]):
        self.stack, self.prompt = stack, prompt
        self.tokens: list[int] = []
        self.ended = threading.Event()

    def run(self) -> Outcome:
        try:
            return run_request(self.stack, "long", self.prompt, LONG_TOKENS, None, self.tokens)
        finally:
            self.ended.set()

    def running(self) -> bool:
        return len(self.tokens) >= 5 and not self.ended.is_set()


def cut_link(stack, what: str, streams: list[Long]) -> tuple[str, list[int | None]]:
    """Cuts decode's link to the broker once a long stream is under way (or every one has ended: a fault may end
    one), and again after decode's re-check; returns what it saw, and each long stream's tokens at the cut (None: it
    had not started or had ended). Waiting for every stream to be under way let the first ones end before the last
    began, in a loaded client whose threads read their streams late."""
    wait_for(lambda: any(s.running() for s in streams) or all(s.ended.is_set() for s in streams), 60,
             "a long stream under way")
    before, at_cut = rechecks(stack), [len(s.tokens) if s.running() else None for s in streams]
    port = stack.procs["broker"][0].port
    if what == "cut_watch":
        stack.arm("broker", "broker.cut_watch", count=3)  # three cuts in a row: each reconnect re-checks
        num_reset = 0
    else:
        num_reset = reset_connections(port)
    wait_for(lambda: sum(rechecks(stack).values()) > sum(before.values()) or not any(s.running() for s in streams),
             20, "decode's re-check after the cut")
    if what == "reset_broker":
        num_reset += reset_connections(port)
    time.sleep(0.5)
    after = rechecks(stack)
    if what == "reset_broker":
        assert num_reset >= 2, f"`ss -K` reset {num_reset} connections to the broker's port {port}"
    return (f"long streams at {at_cut} tokens at the cut; {num_reset} connections reset; re-checks "
            f"{ {o: after[o] - before[o] for o in after} }"), at_cut


def disrupt(stack, what: str, rng: random.Random, record: Record, streams: list[Long]) -> list | tuple | None:
    if what == "hostile":
        return hostile_calls(stack, rng, record.hostile)
    if what in LINK_CUTS:
        return cut_link(stack, what, streams)
    if what == "kill_prefill":
        i = rng.randrange(2)
        window = Window(what, stack.procs["prefill"][i].target, time.monotonic())
        record.windows.append(window)
        record.before_kill("prefill", i)
        stack.restart("prefill", i)
        window.end = time.monotonic()
    elif what == "kill_broker":
        record.before_kill("broker", 0)
        stack.restart("broker", 0)
    elif what.startswith("pause_"):
        proc = stack.procs[what.split("_")[1]][0 if what != "pause_prefill" else rng.randrange(2)]
        window = Window(what, proc.target, time.monotonic())
        record.windows.append(window)  # a paused decode or broker explains no DATA_LOSS (attribution.py)
        os.killpg(proc.popen.pid, signal.SIGSTOP)
        time.sleep(rng.uniform(0.2, 1.0))
        os.killpg(proc.popen.pid, signal.SIGCONT)
        window.end = time.monotonic()


@pytest.mark.parametrize("seed", SEEDS)
def test_chaos_schedule(chaos, oracle, seed):
    disruption = DISRUPTIONS[seed % len(DISRUPTIONS)]
    run_schedule(chaos, oracle, seed, disruption, disrupt, LONG_STREAMS if disruption in LINK_CUTS else 0)


def run_schedule(chaos, oracle, seed: int, disruption: str, disrupt_fn, num_long: int,
                 requests: int = REQUESTS_PER_SCHEDULE) -> None:
    """One seeded schedule of `requests` on the stack, with `disruption` done by disrupt_fn(stack, disruption, rng,
    record, streams) and num_long long streams on the shared prefix started just before it, then every check of
    this module's docstring."""
    print(f"\nchaos schedule seed={seed} (replay: PDSERVE_CHAOS_SEED={seed})", flush=True)
    # the previous schedule's broker restart or pause may have moved decode to a new pool incarnation: it serves
    # again only after the old broker's fence (reader ttl + max ttl + lock delay), so each schedule starts served
    warm = generate_when_served(chaos, [7, 8, 9], 2, timeout=60)
    assert "error" not in warm, warm
    rng = random.Random(seed)
    canaries = chaos.metric("decode", "pdserve_canary_hits_total")
    cache = {r: chaos.metric("decode", "pdserve_prefix_cache_lookup_pages_total", {"result": r}) for r in ("hit", "refused")}
    shared = [rng.randrange(2, 512) for _ in range(SHARED_PREFIX)]
    jobs = []
    for i in range(requests):
        r = rng.random()
        if r < 0.1:
            jobs.append(("overlong", [rng.randrange(2, 512) for _ in range(2048 + rng.randrange(1, 500))], 4, None))
            continue
        prompt = [rng.randrange(2, 512) for _ in range(rng.randrange(1, 200))]
        if rng.random() < SHARED_SHARE:
            prompt = shared + prompt
        cancel = rng.uniform(0.0, 0.4) if r < 0.25 else None
        jobs.append(("cancelled" if cancel is not None else "normal", prompt, rng.randrange(1, 8), cancel))
    choices = [("prefill", f) for f in FAULTS] + OTHER_FAULTS
    faults = [(rng.randrange(requests), *rng.choice(choices), rng.randrange(2)) for _ in range(6)]
    # by (request, fault): two faults armed at one request each get their own argument
    late = {(i, name): str(rng.choice([200, 2500, 5000])) for i, _, name, _ in faults
            if name == "transfer.fail_then_land"}
    late.update({(i, name): rng.choice(CORRUPTIONS) for i, _, name, _ in faults if name == "decode.corrupt_cached"})
    disrupt_at = rng.randrange(10, min(60, requests))
    long_rng = random.Random(-seed - 1)  # its own draws: the schedule's other requests and faults stay as they were
    streams = [Long(chaos, shared + [long_rng.randrange(2, 512) for _ in range(LONG_SUFFIX)])
               for _ in range(num_long)]
    print(f"  disruption={disruption} at request {disrupt_at}; faults={[(i, f) for i, _, f, _ in faults]}", flush=True)
    record = Record(chaos).start()
    results = []
    start = time.monotonic()
    # the long streams and the disruption get threads of their own: queued behind the schedule's requests in the
    # shared pool they started late, and the disruption found every long stream already ended
    with ThreadPoolExecutor(16) as pool, ThreadPoolExecutor(num_long + 1) as side:
        futures = []
        for i, job in enumerate(jobs):
            if i == disrupt_at:
                futures += [side.submit(s.run) for s in streams]
            for at, service, name, which in faults:
                if at == i:
                    which = which if service == "prefill" else 0
                    try:
                        chaos.arm(service, name, arg=late.get((at, name)) or FAULT_ARGS.get(name, "1"), index=which)
                    except grpc.RpcError:
                        pass  # that prefill is being restarted; the fault is simply not armed
            if i == disrupt_at:
                disruption_result = side.submit(disrupt_fn, chaos, disruption, rng, record, streams)
            futures.append(pool.submit(run_request, chaos, *job))
            time.sleep(0.01)
        results = [f.result() for f in futures]
        refusals = disruption_result.result()
    at_cut = None
    if disruption in LINK_CUTS:
        seen, at_cut = refusals
        print(f"  {disruption}: {seen}", flush=True)
    elif refusals is not None:  # every hostile call refused, with a typed reason
        print(f"  hostile calls: {refusals}", flush=True)
        assert all(code in REFUSED and reason for _, code, reason in refusals), (seed, refusals)
    cuts = sum("revocation stream ended" in line for p in chaos.procs["decode"] for line in p.lines)
    if disruption == "cut_watch" or any(name == "broker.cut_watch" for _, _, name, _ in faults):
        print(f"  revocation stream cuts seen by decode so far: {cuts}", flush=True)
    print(f"  load done in {time.monotonic() - start:.1f}s", flush=True)
    ok = 0
    to_check = []
    for kind, prompt, tokens, err, *_ in results:
        if kind == "overlong":
            assert err is not None and err[0] == "INVALID_ARGUMENT" and tokens == [], (seed, err)
            continue
        if err is None:
            ok += 1
        else:
            assert err[0] in TYPED and err[1], (seed, kind, err)
            assert err[1] != "CANARY", (seed, err)
        if tokens:  # a failure's streamed tokens too: what came before it must still be its own KV
            to_check.append((prompt, tokens))
    oracle.check_many(to_check)
    assert ok >= requests // 10, (seed, ok)  # the schedule must exercise successes too
    print(f"  checked {ok} successes at {time.monotonic() - start:.1f}s", flush=True)
    chaos.clear_faults()
    # quiescence: nothing leased; quarantine drains within writer ttl + lock_delay (+ sweep slack)
    try:
        wait_for(lambda: drained(chaos), 20, f"seed {seed}: quiescence")
    except AssertionError:
        raise AssertionError(f"seed {seed}: not quiescent: {chaos.pool_states()}\n{chaos.logs()}") from None
    assert chaos.metric("decode", "pdserve_canary_hits_total") == canaries
    for name, procs in chaos.procs.items():
        for p in procs:
            assert p.alive(), f"seed {seed}: {name} died:\n{''.join(p.lines[-30:])}"
    # after quiescence: a violation counted late (a write that landed at its bound) is in the record too
    record.finish()
    _, unexplained = record.attribute(results, f"seed {seed}")
    assert not unexplained, f"seed {seed}: {len(unexplained)} DATA_LOSS or violations no fault of theirs explains"
    # a cut link ends no stream: only a fault that fired on one may (a lost EndWrite, a corrupt write)
    cut_short = [(len(o.tokens), o.err) for o in results if o.kind == "long" and len(o.tokens) != LONG_TOKENS
                 and not record.fired.get(o.request_id)]
    assert cut_short == [], f"seed {seed}: long streams cut short: {cut_short}"
    if at_cut is not None:  # decode re-checked at least one request that read shared pages while it streamed
        assert any(n is not None for n in at_cut), f"seed {seed}: no long stream ran at the cut: {at_cut}"
    expired = chaos.metric("decode", "pdserve_timeouts_total", {"stage": "allocation"})
    print(f"  quiescent at {time.monotonic() - start:.1f}s (allocations expired by their bound so far: "
          f"{expired:.0f}); cached pages read {chaos.metric('decode', 'pdserve_prefix_cache_lookup_pages_total', {'result': 'hit'}) - cache['hit']:.0f}, "
          f"refused {chaos.metric('decode', 'pdserve_prefix_cache_lookup_pages_total', {'result': 'refused'}) - cache['refused']:.0f}",
          flush=True)
