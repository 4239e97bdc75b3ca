"""The fixed request mix and the statistics every system is reported with.

Every system gets the same prompts (seeded token ids), greedy sampling, ignore_eos and a fixed
max_tokens, under the same closed loop: `concurrency` clients, each sending its next request the
moment its previous one ends, until `num_requests` have been sent.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

MAX_TOKENS = 32
FIRST_TOKEN_ID = 2  # ids 0 and 1 are <s> and </s>


def make_prompts(prompt_len: int, num: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`num` prompts of exactly `prompt_len` token ids, the same for every system and every run."""
    rng = random.Random(f"pdserve-bench/{seed}/{prompt_len}")
    return [[rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(prompt_len)] for _ in range(num)]


@dataclass(slots=True)
class Record:
    """One request as a client saw it: when it was sent, when each token arrived."""
    arrival: float
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def latency(self) -> float:
        return self.token_times[-1] - self.arrival


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); nan for no data."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass(slots=True)
class Summary:
    system: str
    preset: str
    prompt_len: int
    concurrency: int
    num_requests: int
    num_errors: int
    wall_s: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    out_tok_s: float
    req_s: float
    mean_latency: float
    ttft_mean: float = math.nan
    extra: dict = field(default_factory=dict)


def summarize(system: str, preset: str, prompt_len: int, concurrency: int, records: list[Record],
              wall_s: float, extra: dict | None = None) -> Summary:
    ok = [r for r in records if r.error is None and r.token_times]
    ttfts = [r.ttft for r in ok]
    itls = [x for r in ok for x in r.itls]
    out = sum(len(r.token_times) for r in ok)
    return Summary(system, preset, prompt_len, concurrency, len(records), len(records) - len(ok), wall_s,
                   percentile(ttfts, 50), percentile(ttfts, 99), percentile(itls, 50), percentile(itls, 99),
                   out / wall_s if wall_s > 0 else math.nan, len(ok) / wall_s if wall_s > 0 else math.nan,
                   sum(r.latency for r in ok) / len(ok) if ok else math.nan,
                   sum(r.ttft for r in ok) / len(ok) if ok else math.nan, extra or {})


# two-sided 95% Student t critical values by degrees of freedom (no scipy here)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t975(df: int) -> float:
    if df <= 0:
        return math.nan
    for k in sorted(_T975):
        if df <= k:
            return _T975[k]
    return 1.96


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and half-width of its 95% t-interval (nan half-width for fewer than two values)."""
    n = len(xs)
    if n == 0:
        return math.nan, math.nan
    m = sum(xs) / n
    if n < 2:
        return m, math.nan
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, t975(n - 1) * math.sqrt(var / n)


def fmt_ci(m: float, h: float, scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
    if math.isnan(m):
        return "n/a"
    if math.isnan(h):
        return f"{m * scale:.{digits}f}{unit}"
    return f"{m * scale:.{digits}f} ± {h * scale:.{digits}f}{unit}"
