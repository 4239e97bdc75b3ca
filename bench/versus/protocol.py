"""The side-by-side protocol's rules, with no I/O: what is measured, in which order, over which window, and how
the rounds are folded into one figure per cell.

- A cell (prompt length × concurrency) sends until it has sent MIN_REQUESTS requests, or MIN_SECONDS have passed
  and it has sent at least 3 × concurrency (so that the window below keeps at least `concurrency` requests).
- Its figures come from a steady-state window: requests in send order, the first `c` and the last `c` dropped;
  throughput counts every token that arrived between the send of request c and the send of request n - c (all
  clients busy then, in a closed loop), latencies come from the kept requests.
- Rounds: every system once per round, one at a time, the order reversed each round (A B C, C B A, A B C ...),
  so a drift in the machine's other load favours none of them.
- Rounds fold into the median of the per-round ratios, with their spread (min–max over rounds).
- A cell whose outside load passed LOAD_LIMIT_CORES is re-run once; still over it, it is kept and flagged.
- Open loop (concurrency ≥ 4): a seeded Poisson schedule at OPEN_LOOP_FACTOR × the slowest system's closed-loop
  req/s at that cell in the first round, the same rate for every system in every later round.
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

MIN_REQUESTS = 64
MIN_SECONDS = 20.0
LOAD_LIMIT_CORES = 0.1
OPEN_LOOP_FACTOR = 0.7
OPEN_LOOP_SECONDS = 20.0
MIN_OPEN_KEPT = 8           # an open-loop cell keeps at least this many requests after the trimming
ROUNDS = {"full": 3, "quick": 2}
OUTPUT_TOKENS = 32
FIRST_TOKEN_ID = 2          # ids 0 and 1 are <s> and </s>


@dataclass(slots=True, frozen=True, order=True)
class Cell:
    prompt_len: int
    concurrency: int

    @property
    def key(self) -> str:
        return f"{self.prompt_len}x{self.concurrency}"


def cells(mode: str) -> list[Cell]:
    if mode == "quick":
        return [Cell(128, 1), Cell(1024, 4), Cell(4096, 1)]
    return [Cell(p, c) for p in (128, 1024, 4096) for c in (1, 4, 16)]


def round_order(systems: list[str], r: int) -> list[str]:
    """Round r's order: as given in even rounds, reversed in odd ones (ABAB for two systems)."""
    return list(systems) if r % 2 == 0 else list(reversed(systems))


def keep_sending(sent: int, elapsed_s: float, concurrency: int) -> bool:
    """Whether a closed loop sends one more request."""
    if sent >= MIN_REQUESTS:
        return False
    return elapsed_s < MIN_SECONDS or sent < 3 * concurrency


def prompts(cell: Cell, r: int, loop: str, num: int, vocab_size: int) -> list[list[int]]:
    """`num` prompts of the cell's length, the same for every system, distinct across cells, rounds and loops (no
    prefix-cache hit anywhere: a random token every position of a 512-token vocabulary)."""
    rng = random.Random(f"pdserve-versus/{loop}/{r}/{cell.prompt_len}/{cell.concurrency}")
    return [[rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(cell.prompt_len)] for _ in range(num)]


MAX_KEPT_MISMATCHES = 8     # per system pair, round, cell and loop: a broken system must not bloat the run's JSON


def id_mismatches(ours: list[list[int] | None], theirs: list[list[int] | None]) -> list[dict]:
    """Requests whose greedy ids differ (index i of both, where both streamed), at most MAX_KEPT_MISMATCHES: the
    index, which with the cell, round and loop names the prompt (prompts() above), and both id lists, all that the
    float64 reference needs to judge the divergence again (ties.py)."""
    return [{"index": i, "ours": list(x), "theirs": list(y)}
            for i, (x, y) in enumerate(zip(ours, theirs)) if x and y and list(x) != list(y)][:MAX_KEPT_MISMATCHES]


def open_loop_rate(closed_req_s: dict[str, float]) -> float:
    """The arrival rate every system's open loop gets at a cell: a share of the slowest closed loop there."""
    rates = [x for x in closed_req_s.values() if x > 0 and not math.isnan(x)]
    if not rates:
        raise ValueError(f"no closed-loop req/s to set an open-loop rate from: {closed_req_s}")
    return OPEN_LOOP_FACTOR * min(rates)


def open_loop_requests(rate: float, concurrency: int) -> int:
    """Requests of an open-loop cell: OPEN_LOOP_SECONDS at `rate`, at least enough to keep MIN_OPEN_KEPT after
    the first and last `concurrency` are dropped, at most MIN_REQUESTS."""
    return min(MIN_REQUESTS, max(round(rate * OPEN_LOOP_SECONDS), 2 * concurrency + MIN_OPEN_KEPT))


@dataclass(slots=True, frozen=True)
class Window:
    """The steady-state part of one cell's run."""
    start: float            # send time of the first kept request
    end: float              # send time of the first request dropped at the tail
    kept: list              # the kept records, in send order

    @property
    def seconds(self) -> float:
        return self.end - self.start


def steady_window(records: list, concurrency: int) -> Window:
    """Records (anything with .arrival) in send order, less the first and the last `concurrency`."""
    ordered = sorted(records, key=lambda r: r.arrival)
    n = len(ordered)
    if n < 2 * concurrency + 1:
        raise ValueError(f"steady_window: {n} requests leave none once the first and last {concurrency} are dropped")
    return Window(ordered[concurrency].arrival, ordered[n - concurrency].arrival, ordered[concurrency:n - concurrency])


def tokens_in(records: list, start: float, end: float) -> int:
    """Tokens of any request (records with .token_times) that arrived in [start, end)."""
    return sum(1 for r in records for t in r.token_times if start <= t < end)


def finished_in(records: list, start: float, end: float) -> int:
    return sum(1 for r in records if r.error is None and r.token_times and start <= r.token_times[-1] < end)


def loaded(other_cores: float) -> bool:
    """More outside load than the protocol takes as quiet (nan: not known, so not quiet)."""
    return not other_cores <= LOAD_LIMIT_CORES


def median(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


def ratio_spread(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Median, min and max over rounds of a[i] / b[i] (round i of both; a round missing either is skipped)."""
    rs = [x / y for x, y in zip(a, b) if x is not None and y is not None and not (math.isnan(x) or math.isnan(y))
          and y != 0]
    if not rs:
        return math.nan, math.nan, math.nan
    return statistics.median(rs), min(rs), max(rs)


def better(per_system: dict[str, list[float]], higher_is_better: bool) -> str | None:
    """The system whose median over rounds is best (the 'faster vLLM' of a figure at a cell)."""
    meds = {k: median(v) for k, v in per_system.items()}
    meds = {k: m for k, m in meds.items() if not math.isnan(m)}
    if not meds:
        return None
    return (max if higher_is_better else min)(meds, key=meds.get)


# the acceptance targets: (figure, which concurrencies, bound on pdserve / best vLLM, higher is better)
TARGETS = (("out_tok_s", (4, 16), 1.0, True), ("out_tok_s", (1,), 0.9, True), ("ttft_p50", (1,), 1.0, False),
           ("open_ttft_p50", (4, 16), 1.0, False), ("cpu_s_per_request", (1, 4, 16), 1.0, False))


def verdict(ratio: float, bound: float, higher_is_better: bool) -> str:
    if math.isnan(ratio):
        return "not measured"
    ok = ratio >= bound if higher_is_better else ratio <= bound
    return "met" if ok else "MISSED"


def poisson_offsets(rate: float, num: int, seed: str) -> list[float]:
    """`num` send times (s after the start) of a Poisson process at `rate` req/s, the same for every system."""
    if not rate > 0 or num < 1:
        raise ValueError(f"poisson_offsets: rate {rate} req/s and {num} requests must both be > 0")
    rng, t, out = random.Random(f"pdserve-versus/poisson/{seed}"), 0.0, []
    for _ in range(num):
        t += rng.expovariate(rate)
        out.append(t)
    return out
