"""The guard-cost A/B: pairs that alternate which stack goes first and never repeat a prompt, the series' guard
counters attached to each stack's last run, the paired differences and guard shares the report derives."""
import math
from dataclasses import asdict

import pytest

from pdserve.bench.harness.stack import BenchStack
from pdserve.bench.harness.workload import Record, Summary, mean_ci, summarize
from pdserve.bench.report import costs
from pdserve.bench.scenarios import preset
from pdserve.bench.scenarios.plan import Cell, quick


def _summary(checksums, pair, first, ttft, tok_s, conc=1, guard=None, series=None, errors=0):
    extra = {"checksums": checksums, "pair": pair, "first": first, "ab_cell": 0 if conc == 1 else 1}
    if guard is not None:
        extra["guard"] = guard
    if series is not None:
        extra["series"] = series
    return Summary("pdserve", "tiny", 1024 if conc == 1 else 128, conc, 1 if conc == 1 else 16, errors, 1.0,
                   ttft, ttft, 0.005, 0.005, tok_s, 1.0, 0.1, ttft, extra)


def _series(requests=10, ttft_guard_s=0.02, tag_s=0.001, sweep_s=0.0005, steps=100):
    guard = {k: 0.0 for k in ("grant_rpc", "begin_write_rpc", "begin_write_wait", "end_write_rpc", "validate_rpc",
                              "release_rpc", "checksum", "prompt_verify", "step_tag_check", "checksum_sweep")}
    guard.update(grant_rpc=ttft_guard_s / 2, prompt_verify=ttft_guard_s / 2, step_tag_check=tag_s,
                 checksum_sweep=sweep_s, release_rpc=5.0)  # release runs after the last token: never charged
    return {"guard": guard, "guard_calls": {}, "steps": steps, "step_forward_s": 0.2, "first_tokens": requests,
            "cpu": {"decode": 1.0}, "wall_s": 5.0,
            "step_buckets": {"step_tag_check": {"5e-05": 60.0, "0.0001": 90.0, "+Inf": 100.0}}}


def test_paired_differences_are_on_over_off_per_pair_with_a_t_interval():
    ons = [0.102, 0.099, 0.205, 0.051]   # the machine's load moves both halves of a pair together
    offs = [0.100, 0.097, 0.200, 0.050]
    ab = []
    for i, (a, b) in enumerate(zip(ons, offs)):
        ab += [_summary(True, i, i % 2 == 0, a, 1 / a), _summary(False, i, i % 2 == 1, b, 1 / b)]
    ab.append(_summary(True, 9, True, 0.5, 2.0, errors=1))  # a failed pair is dropped, not half-counted
    ab.append(_summary(False, 9, False, 0.1, 10.0))
    lines, effects = costs.checksum_ab(ab)
    d_thr, d_ttft, n = effects[1]
    want = mean_ci([a / b - 1 for a, b in zip(ons, offs)])
    assert n == 1024
    assert d_ttft == pytest.approx(want)
    assert d_thr[0] == pytest.approx(mean_ci([b / a - 1 for a, b in zip(ons, offs)])[0])
    assert d_ttft[0] == pytest.approx(0.0212, abs=1e-3) and d_ttft[1] < 0.01  # the pairs resolve ~2 % apart
    row = next(line for line in lines if line.startswith("| 1024 | 1 |"))
    assert "| 4 | 1 |" in row  # 4 pairs kept, 1 dropped


def test_guard_shares_come_from_the_series_and_the_loaded_runs():
    series = _series(requests=4, ttft_guard_s=0.04)  # 10 ms of guards before the first token, per request
    ab = [_summary(True, i, True, t, 1.0) for i, t in enumerate((0.5, 1.0, 0.5, 1.0))]
    ab[-1].extra["series"] = series
    ab += [_summary(False, i, False, 0.5, 1.0) for i in range(4)]
    loaded = [_summary(True, i, True, 0.3, 400.0, conc=16, guard={"step_tag_check": f / 2, "checksum_sweep": f / 2})
              for i, f in enumerate((0.010, 0.012))]
    ttft, thr, ttft_cell, thr_cell = costs._guard_shares(ab + loaded)
    assert ttft[0] == pytest.approx(mean_ci([0.01 / 0.5, 0.01 / 1.0] * 2)[0]) and ttft[2] == 4
    assert thr[0] == pytest.approx(0.011) and thr[2] == 2  # per-step guard seconds over each run's wall (1 s)
    assert ttft_cell.concurrency == 1 and thr_cell.concurrency == 16


def test_series_table_charges_per_step_guards_per_step_and_ttft_guards_per_request():
    ab = [_summary(True, 0, True, 0.1, 10.0, series=_series()), _summary(False, 0, False, 0.1, 10.0)]
    row = next(line for line in costs._series_table(ab) if line.startswith("| 1024"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:7] == ["on", "10", "100", "10.0", "42 / 100"]  # 1 ms over 100 steps; p50 / p90 in the cumulative buckets
    assert cells[7] == "5.0" and cells[11] == "2.00"  # sweep 0.5 ms / 100 steps; 20 ms / 10 requests


class FakeStack:
    """Records who got which prompts in which order; counters that grow by a known amount per request. slow
    stretches its times (a stack slot slower by itself), load(prompts) the machine's load when they are sent."""

    def __init__(self, checksums, calls, slow=1.0, load=lambda prompts: 1.0):
        self.checksums, self.calls, self.n, self.slow, self.load = checksums, calls, 0, slow, load
        self.closed = False

    def send(self, prompts, concurrency, max_tokens):
        return self._go(prompts, concurrency)

    def run(self, system, preset_, prompts, concurrency):
        recs, wall = self._go(prompts, concurrency, system)
        return summarize(system, preset_, len(prompts[0]), concurrency, recs, wall), recs

    def _go(self, prompts, concurrency, system=""):
        assert not self.closed
        self.calls.append((self.checksums, tuple(map(tuple, prompts)), concurrency, system))
        self.n += len(prompts)
        t = 0.1 * self.slow * self.load(prompts)
        return [Record(0.0, token_times=[t, 2 * t], token_ids=[3, 4]) for _ in prompts], 2 * t

    def close(self):
        self.closed = True

    def guard_sample(self):
        return {"n": self.n}

    series_cost = staticmethod(lambda before, after: {"requests": after["n"] - before["n"]})


def _bench(monkeypatch, calls, slow_a=1.0, load=lambda prompts: 1.0):
    """A quick bench whose restarted stacks are fakes; slot A (which starts on, then off) is slow_a slower."""
    monkeypatch.setitem(preset.AB_SECONDS, "quick", 0.0)  # the minimum number of pairs, then stop
    bench = preset.Bench(quick(), profile=False)
    monkeypatch.setattr(bench, "_start_stack", lambda model_dir, checksums: FakeStack(
        checksums, calls, slow_a if not checksums else 1.0, load))
    stacks = [FakeStack(True, calls, slow_a, load), FakeStack(False, calls, 1.0, load)]
    return bench, stacks


PP = type("PP", (), {"preset": "tiny", "ab": (Cell(1024, 1, 3), Cell(128, 16, 16))})()


def test_the_scenario_swaps_the_flags_between_the_slots_alternates_who_goes_first_and_never_repeats_a_prompt(
        monkeypatch):
    calls = []
    bench, stacks = _bench(monkeypatch, calls)
    old = list(stacks)
    bench._checksum_ab(PP, stacks, "model", 512)
    assert all(s.closed for s in old) and [s.checksums for s in stacks] == [False, True]  # slot A now off
    k = -(-preset.AB_MIN_PAIRS // 2)  # pairs per half
    warm = [c for c in calls if c[3] == "warmup"]
    assert len(warm) == 4 and calls[4 * k:4 * k + 4] == warm  # restarted, both warmed at both lengths, between halves
    ab = [r for r in calls if r[3] != "warmup"]
    assert len(ab) == 2 * 2 * 2 * k
    for half, flag_a, pairs in ((ab[:4 * k], True, range(k)), (ab[4 * k:], False, range(k, 2 * k))):
        single = half[:2 * k]
        # slot A first in even pairs, B in odd ones; slot A holds on in the first half, off in the second
        assert [c[0] for c in single[::2]] == [(i % 2 == 0) == flag_a for i in pairs]
    ab_rows = bench.res["ab"]
    assert len(ab_rows) == 4 * 2 * k
    for cell, size, conc in ((0, 1, 1), (1, 16, 16)):
        mine = [c for c in ab if c[2] == conc]
        assert all(a[1] == b[1] and a[0] != b[0] for a, b in zip(mine[::2], mine[1::2]))  # a pair: same prompts
        prompts = [p for c in mine[::2] for p in c[1]]
        assert len(set(prompts)) == len(prompts) == 2 * k * size
        rows = [r["extra"] for r in ab_rows if r["extra"]["ab_cell"] == cell]
        assert sorted({r["pair"] for r in rows}) == list(range(2 * k))
        assert all(r["slot"] == (0 if r["checksums"] == (r["half"] == 0) else 1) for r in rows)
        assert all(r["first"] == (r["pair"] % 2 == r["slot"]) for r in rows)
    with_series = [r["extra"] for r in ab_rows if "series" in r["extra"]]
    assert sorted((r["ab_cell"], r["half"], r["checksums"], r["series"]["requests"]) for r in with_series) == [
        (c, h, f, k * (16 if c else 1)) for c in (0, 1) for h in (0, 1) for f in (False, True)]


def test_a_slot_that_is_slower_by_itself_is_removed_from_on_minus_off_and_shown(monkeypatch):
    """Checksums cost nothing here; slot A's stack is 20 % slower by itself, and the machine's load moves each
    pair's two halves together by up to ±40 %. The protocol that never swapped the slots reported +20 %."""
    import random

    rng = random.Random(5)
    loads = {}

    def load(prompts):  # the same load for both requests of a pair: keyed by its prompts
        return loads.setdefault(tuple(prompts[0]), rng.uniform(0.6, 1.4))

    monkeypatch.setattr(preset, "AB_MIN_PAIRS", 40)
    bench, stacks = _bench(monkeypatch, [], slow_a=1.2, load=load)
    bench._checksum_ab(PP, stacks, "model", 512)
    ab = [Summary(**r) for r in bench.res["ab"]]
    lines, effects = costs.checksum_ab(ab)
    (d_thr, d_ttft, n), (d_thr16, _, _) = effects[1], effects[16]
    assert d_ttft[0] == pytest.approx(0.0, abs=1e-9) and d_thr[0] == pytest.approx(0.0, abs=1e-9)
    assert d_thr16[0] == pytest.approx(0.0, abs=1e-9)
    row = next(line for line in lines if line.startswith("| 1024 | 1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[5] == "20 / 20" and cells[15].startswith("20.00") and cells[16].startswith("-16.67")
    first_half = [s for s in ab if s.extra["half"] == 0]  # what the slot-bound protocol measured
    assert costs.checksum_ab(first_half)[1][1][1][0] == pytest.approx(0.2)


def test_the_slot_model_gives_the_halves_mean_and_a_pooled_interval():
    xs, signs = [0.3, 0.1, 0.2, -0.2, -0.1, -0.3, -0.2], [1, 1, 1, -1, -1, -1, -1]
    effect, h, slot, hs, adj = costs.slot_model(xs, signs)
    assert effect == pytest.approx((0.2 + -0.2) / 2) and slot == pytest.approx(0.2)
    pooled = (0.02 + 0.02) / 5  # squared deviations from each group's mean over n − 2
    assert h == hs == pytest.approx(costs.t975(5) * (pooled / 4 * (1 / 3 + 1 / 4)) ** 0.5)
    assert adj == pytest.approx([0.1, -0.1, 0.0, 0.0, 0.1, -0.1, 0.0])
    assert costs.slot_model([0.1, 0.3], [1, 1])[:3] == (0.2, mean_ci([0.1, 0.3])[1], pytest.approx(float("nan"),
                                                                                                     nan_ok=True))


def test_series_cost_is_the_difference_of_two_samples():
    keys = ("grant_rpc", "begin_write_rpc", "begin_write_wait", "end_write_rpc", "validate_rpc", "release_rpc",
            "checksum", "prompt_verify", "step_tag_check", "checksum_sweep")
    a = {f"guard_s.{k}": 1.0 for k in keys} | {f"guard_n.{k}": 2.0 for k in keys} | {
        "guard_b.step_tag_check.5e-05": 3.0, "guard_b.checksum_sweep.+Inf": 1.0, "steps": 10.0,
        "step_forward_s": 0.5, "first_tokens": 1.0, "cpu_s.decode": 4.0, "cpu_s.wall": 100.0}
    b = {k: v * 3 for k, v in a.items()}
    d = BenchStack.series_cost(a, b)
    assert d["guard"]["step_tag_check"] == 2.0 and d["guard_calls"]["checksum"] == 4.0
    assert d["steps"] == 20.0 and d["first_tokens"] == 2.0 and d["wall_s"] == 200.0 and d["cpu"] == {"decode": 8.0}
    assert d["step_buckets"] == {"step_tag_check": {"5e-05": 6.0}, "checksum_sweep": {"+Inf": 2.0}}
    assert not math.isnan(d["step_forward_s"])
