"""Open-loop load: a seeded Poisson arrival schedule, and the goodput it is judged by.

A closed loop slows its own arrivals when the system slows, so it never shows overload. Here request i is
sent at its scheduled time whether or not earlier ones finished, and its TTFT counts from that time (a late
send is the system's delay, not a free pause). A client gives up (cancels) when no first token has arrived
by its deadline, as a user or an upstream timeout does.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from .workload import Record

SLO_FACTOR = 10.0       # the TTFT SLO: this many times co-located's unloaded TTFT p50 at the same prompt length
DEADLINE_FACTOR = 2.0   # clients give up this many SLOs after their send with no first token
GAVE_UP = "GAVE_UP"     # the error of a request its client cancelled at the deadline


def unit_gaps(num: int, seed: int = 0) -> list[float]:
    """`num` exponential inter-arrival gaps of mean 1, the same for every system and every run."""
    rng = random.Random(f"pdserve-bench/poisson/{seed}")
    return [rng.expovariate(1.0) for _ in range(num)]


def poisson_offsets(rate: float, seconds: float, min_requests: int, max_requests: int,
                    seed: int = 0) -> list[float]:
    """Send times (s after the start) of a Poisson process at `rate` req/s over `seconds`: rate × seconds
    requests, at least `min_requests` (a slow rate still yields a sample), at most `max_requests` (the
    machine's own limit); the first goes at its first gap, not at 0."""
    if not rate > 0 or not seconds > 0:
        raise ValueError(f"poisson_offsets: rate {rate} req/s and seconds {seconds} must be > 0")
    if not 1 <= min_requests <= max_requests:
        raise ValueError(f"poisson_offsets: need 1 <= min_requests ({min_requests}) <= max_requests ({max_requests})")
    num = min(max(round(rate * seconds), min_requests), max_requests)
    out, t = [], 0.0
    for g in unit_gaps(num, seed):
        t += g / rate
        out.append(t)
    return out


@dataclass(slots=True, frozen=True)
class Slo:
    """The TTFT limit a request must meet to count as goodput, and when its client gives up."""
    ttft_s: float
    deadline_s: float

    @classmethod
    def from_unloaded(cls, unloaded_ttft_s: float) -> Slo:
        if not unloaded_ttft_s > 0:
            raise ValueError(f"Slo: unloaded TTFT must be > 0 s, got {unloaded_ttft_s}")
        slo = SLO_FACTOR * unloaded_ttft_s
        return cls(slo, DEADLINE_FACTOR * slo)


def goodput(records: list[Record], slo: Slo, wall_s: float, max_tokens: int) -> dict:
    """Counts and rates of one open-loop level. *good*: every token arrived (max_tokens of them) and the first
    within the SLO; goodput is good requests per second of the level's wall time (first send to the last
    request's end or abandonment)."""
    if not wall_s > 0:
        raise ValueError(f"goodput: wall time must be > 0 s, got {wall_s}")
    finished = [r for r in records if r.error is None and len(r.token_ids) == max_tokens]
    good = [r for r in finished if r.ttft <= slo.ttft_s]
    gave_up = sum(r.error == GAVE_UP for r in records)
    return {"offered": len(records), "finished": len(finished), "good": len(good), "gave_up": gave_up,
            "errors": len(records) - len(finished) - gave_up, "goodput_req_s": len(good) / wall_s,
            "good_share": len(good) / len(records) if records else math.nan}


def goodput_ratio(levels: list[dict], multiple: float) -> float:
    """Goodput at `multiple` × saturation over goodput at 1× (nan when either level is missing or 1× had none)."""
    by = {lv["multiple"]: lv["goodput"]["goodput_req_s"] for lv in levels}
    base = by.get(1.0)
    if multiple not in by or not base:
        return math.nan
    return by[multiple] / base


PREFILL_COUNTERS = {"sequences": ("pdserve_prefill_sequences_total", ""),
                    "forward_for_gone": ("pdserve_prefill_forward_for_gone_total", ""),
                    "dropped_deadline": ("pdserve_prefill_dropped_total", 'reason="deadline"'),
                    "dropped_cancelled": ("pdserve_prefill_dropped_total", 'reason="cancelled"')}
PREFILL_PASSES = ("pdserve_forward_seconds_count", 'phase="prefill"')


def prefill_counts(before: dict, after: dict) -> dict:
    """What prefill did over one level, from two /metrics scrapes: each counter's increase, None where prefill
    does not export it. `counted` says whether its queue counters are live: they are registered in every process
    that imports the metrics module, so a prefill that never increments them shows 0 sequences while its forward
    passes (`pdserve_forward_seconds`) ran; their zeros then mean "not counted", not "none"."""
    out: dict = {k: (after[key] - before.get(key, 0.0) if key in after else None)
                 for k, key in PREFILL_COUNTERS.items()}
    # a labelled counter appears only once a label was used: absent with `sequences` present is a true 0
    for k in ("dropped_deadline", "dropped_cancelled"):
        if out[k] is None and out["sequences"] is not None:
            out[k] = 0.0
    out["passes"] = after.get(PREFILL_PASSES, 0.0) - before.get(PREFILL_PASSES, 0.0)
    out["counted"] = out["sequences"] is not None and out["forward_for_gone"] is not None and \
        (out["sequences"] > 0 or out["passes"] == 0)
    return out
