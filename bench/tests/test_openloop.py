"""The open-loop sweep's arithmetic: the Poisson schedule, the SLO, goodput, prefill's counters, and the
co-located engine serving a schedule on a fake clock (arrivals at their times, callers gone before their pass
never prefilled)."""
import math
import types

import pytest
import torch

from pdserve.bench.harness.openloop import (GAVE_UP, PREFILL_COUNTERS, PREFILL_PASSES, Slo, goodput, goodput_ratio,
                                    poisson_offsets, prefill_counts)
from pdserve.bench.harness.workload import Record


def test_schedule_is_poisson_at_the_rate():
    rate = 40.0
    offs = poisson_offsets(rate, 500.0, 1, 100_000, seed=7)
    assert len(offs) == 20_000
    gaps = [b - a for a, b in zip([0.0] + offs, offs)]
    assert all(g > 0 for g in gaps)
    mean = sum(gaps) / len(gaps)
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (len(gaps) - 1))
    # exponential gaps: mean 1/rate, standard deviation equal to the mean, P(gap > mean) = 1/e
    assert mean == pytest.approx(1 / rate, rel=0.03)
    assert sd / mean == pytest.approx(1.0, rel=0.05)
    assert sum(g > 1 / rate for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.02)
    # arrivals in disjoint 1-s windows are Poisson counts: variance equal to the mean
    counts = [0] * 500
    for t in offs:
        counts[min(int(t), 499)] += 1
    m = sum(counts) / len(counts)
    assert sum((c - m) ** 2 for c in counts) / (len(counts) - 1) / m == pytest.approx(1.0, rel=0.2)


def test_schedule_is_seeded_and_the_same_shape_at_every_rate():
    a, b = poisson_offsets(5.0, 4.0, 1, 100), poisson_offsets(20.0, 1.0, 1, 100)
    assert a == poisson_offsets(5.0, 4.0, 1, 100)
    assert len(a) == len(b) == 20
    assert [x * 5.0 for x in a] == pytest.approx([x * 20.0 for x in b])  # the same unit gaps, scaled
    assert poisson_offsets(5.0, 4.0, 1, 100, seed=1) != a


def test_schedule_bounds_and_bad_arguments():
    assert len(poisson_offsets(0.5, 2.0, 6, 10)) == 6   # 1 request by rate, raised to the minimum
    assert len(poisson_offsets(100.0, 2.0, 6, 10)) == 10
    for args in ((0.0, 1.0, 1, 2), (1.0, 0.0, 1, 2), (1.0, 1.0, 3, 2), (1.0, 1.0, 0, 2), (math.nan, 1.0, 1, 2)):
        with pytest.raises(ValueError):
            poisson_offsets(*args)


def test_slo_from_unloaded_ttft():
    slo = Slo.from_unloaded(0.025)
    assert (slo.ttft_s, slo.deadline_s) == pytest.approx((0.25, 0.5))
    with pytest.raises(ValueError):
        Slo.from_unloaded(math.nan)


def _rec(ttft: float | None, tokens: int, error: str | None = None) -> Record:
    r = Record(0.0, error=error)
    if ttft is not None:
        r.token_times = [ttft + 0.01 * i for i in range(tokens)]
        r.token_ids = list(range(2, 2 + tokens))
    return r


def test_goodput_counts_only_complete_requests_within_the_slo():
    slo = Slo(0.2, 0.4)
    recs = [_rec(0.1, 4), _rec(0.2, 4),                 # good (the limit itself counts)
            _rec(0.3, 4),                               # finished, TTFT over the SLO
            _rec(0.1, 3, "CANCELLED stream broke"),     # an error after some tokens
            _rec(0.1, 3),                               # fewer tokens than asked for: not finished
            _rec(None, 0, GAVE_UP), _rec(None, 0, GAVE_UP),
            _rec(None, 0, "RESOURCE_EXHAUSTED busy")]
    g = goodput(recs, slo, 4.0, max_tokens=4)
    assert g == {"offered": 8, "finished": 3, "good": 2, "gave_up": 2, "errors": 3,
                 "goodput_req_s": 2 / 4.0, "good_share": 2 / 8}
    with pytest.raises(ValueError):
        goodput(recs, slo, 0.0, 4)


def test_goodput_ratio_against_saturation():
    levels = [{"multiple": m, "goodput": {"goodput_req_s": v}} for m, v in ((1.0, 8.0), (2.0, 7.6), (4.0, 2.0))]
    assert goodput_ratio(levels, 4.0) == pytest.approx(0.25)
    assert goodput_ratio(levels, 2.0) == pytest.approx(0.95)
    assert math.isnan(goodput_ratio(levels, 0.5))
    assert math.isnan(goodput_ratio(levels[1:], 2.0))  # no 1× level
    levels[0]["goodput"]["goodput_req_s"] = 0.0
    assert math.isnan(goodput_ratio(levels, 2.0))


def test_prefill_counts_tell_zero_from_not_counted():
    seq, gone = PREFILL_COUNTERS["sequences"], PREFILL_COUNTERS["forward_for_gone"]
    drop = PREFILL_COUNTERS["dropped_deadline"]
    live = prefill_counts({seq: 2.0, gone: 0.0, PREFILL_PASSES: 2.0},
                          {seq: 12.0, gone: 1.0, drop: 3.0, PREFILL_PASSES: 7.0})
    assert (live["sequences"], live["forward_for_gone"], live["dropped_deadline"], live["dropped_cancelled"],
            live["passes"], live["counted"]) == (10.0, 1.0, 3.0, 0.0, 5.0, True)
    # registered but never incremented while forward passes ran: zeros that mean "not counted"
    dead = prefill_counts({seq: 0.0, gone: 0.0, PREFILL_PASSES: 3.0}, {seq: 0.0, gone: 0.0, PREFILL_PASSES: 9.0})
    assert (dead["sequences"], dead["passes"], dead["counted"]) == (0.0, 6.0, False)
    absent = prefill_counts({PREFILL_PASSES: 0.0}, {PREFILL_PASSES: 4.0})
    assert absent["sequences"] is None and absent["dropped_deadline"] is None and not absent["counted"]


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def perf_counter(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


class FakeRunner:
    """Stands in for ModelRunner in Colocated's scheduling tests: a prefill costs 1 s and a decode step 0.1 s
    of the fake clock; greedy tokens follow a rule the test recomputes (first: sum(prompt) mod V; then
    previous token + position mod V)."""
    V = 64

    def __init__(self, clock: FakeClock, num_pages: int, page_size: int):
        self.clock, self.page_size, self.prefilled = clock, page_size, []
        self.config = types.SimpleNamespace(vocab_size=self.V)
        self.pool = types.SimpleNamespace(num_pages=num_pages)

    def _onehot(self, ids: list[int]) -> torch.Tensor:
        x = torch.zeros(len(ids), self.V)
        x[range(len(ids)), ids] = 1.0
        return x

    def prefill(self, prompt, pages):
        self.clock.t += 1.0
        self.prefilled.append(list(prompt))
        return self._onehot([sum(prompt) % self.V])

    def decode(self, tokens, positions, page_tables):
        self.clock.t += 0.1
        return self._onehot([(t + p) % self.V for t, p in zip(tokens, positions)])


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    out = [sum(prompt) % FakeRunner.V]
    while len(out) < n:
        out.append((out[-1] + len(prompt) + len(out) - 1) % FakeRunner.V)
    return out


@pytest.fixture
def fake(monkeypatch):
    from pdserve.bench.peers import colocated

    clock = FakeClock()
    monkeypatch.setattr(colocated, "time", types.SimpleNamespace(perf_counter=clock.perf_counter, sleep=clock.sleep,
                                                                 process_time=lambda: 0.0))
    monkeypatch.setattr(colocated, "ModelRunner", lambda _dir, num_pages, page_size, device: FakeRunner(
        clock, num_pages, page_size))
    return colocated.Colocated("unused", pool_tokens=1024)


PROMPTS = [[5] * 16, [7] * 20, [9] * 30]


def test_colocated_open_loop_serves_the_schedule(fake):
    # r0 at 0 s: prefilled until 1.0, one step (1.1); r1, sent at 0.5 s, is picked up at 1.1 s and gets its token
    # at 2.1 s, 1.6 s after its send, within the 1.7 s deadline; two steps finish both (2.3); the engine idles
    # until r2 at 3.0 s
    recs, wall = fake.run_open(PROMPTS, [0.0, 0.5, 3.0], 3, deadline_s=1.7)
    assert [r.arrival for r in recs] == pytest.approx([0.0, 0.5, 3.0])
    assert [r.error for r in recs] == [None] * 3
    assert [r.token_ids for r in recs] == [expected_tokens(p, 3) for p in PROMPTS]
    assert [r.ttft for r in recs] == pytest.approx([1.0, 1.6, 1.0])  # from the schedule, not the pick-up
    assert wall == pytest.approx(4.2)
    assert fake.alloc.can_allocate(fake.runner.pool.num_pages)  # every page given back
    with pytest.raises(ValueError):
        fake.run_open(PROMPTS, [0.0], 3, deadline_s=1.0)


def test_colocated_open_loop_gives_up_callers_gone(fake):
    # three at once, 1.5 s deadline, prefill first: r0's token at 1.0 s is delivered; r1 is prefilled from
    # 1.0 s (still within its deadline) but its token at 2.0 s reaches no one; r2, still waiting at 2.0 s, is
    # dropped before its pass
    recs, wall = fake.run_open(PROMPTS, [0.0, 0.0, 0.0], 3, deadline_s=1.5)
    assert [r.error for r in recs] == [None, GAVE_UP, GAVE_UP]
    assert recs[0].token_ids == expected_tokens(PROMPTS[0], 3) and recs[1].token_ids == recs[2].token_ids == []
    assert fake.runner.prefilled == PROMPTS[:2] and fake.last_split["prefills"] == 2
    assert wall == pytest.approx(2.2)
    assert fake.alloc.can_allocate(fake.runner.pool.num_pages)


def test_colocated_closed_loop_unchanged(fake):
    recs, wall = fake.run(PROMPTS, 2, 4)
    assert [r.token_ids for r in recs] == [expected_tokens(p, 4) for p in PROMPTS]
    assert recs[2].arrival == recs[0].token_times[-1]  # the third is sent when the first client's request ends
    assert all(r.error is None for r in recs) and wall > 0
