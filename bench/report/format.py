"""Report building blocks: number formats, the Markdown table, lookups over runs and target verdicts."""
from __future__ import annotations

import math

from ..harness.stack import STEP_KINDS, TTFT_KINDS
from ..harness.workload import Summary

NAN = math.nan
TTFT_GAP_SLACK_S = 0.003  # issue 12: TTFT p50 − co-located ≤ the measured transfer + this, at concurrency 1


def _ms(x) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x * 1e3:.1f}"


def _ms2(x) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x * 1e3:.2f}"


def _x(x) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.2f}×"


def _pct(x) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x * 100:.1f}%"


def _div(a: float, b: float) -> float:
    return a / b if b else NAN


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"] + \
           ["| " + " | ".join(str(c) for c in r) + " |" for r in rows] + [""]


def _hist_quantile(buckets: dict[str, float], q: float) -> float:
    edges = sorted((float(le), c) for le, c in buckets.items())
    if not edges or edges[-1][1] <= 0:
        return NAN
    rank, lo_edge, lo_count = q * edges[-1][1], 0.0, 0.0
    for edge, count in edges:
        if count >= rank:
            return lo_edge if math.isinf(edge) else lo_edge + (edge - lo_edge) * (rank - lo_count) / max(count - lo_count, 1e-12)
        lo_edge, lo_count = edge, count
    return lo_edge


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return NAN if not s else (s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2)


def _find(runs: list[Summary], system: str, preset: str, n: int, c: int | None = None) -> Summary | None:
    for s in runs:
        if s.system == system and s.preset == preset and s.prompt_len == n and (c is None or s.concurrency == c):
            return s
    return None


def _ok(s: Summary) -> int:
    return s.num_requests - s.num_errors


def _mean_rpc(s: Summary, key: str) -> float:
    total, count = s.extra.get("rpc", {}).get(key, (0.0, 0.0))
    return _div(total, count)


def guard_fractions(s: Summary) -> tuple[float, float]:
    """(guard time before the first token, per request / TTFT p50; per-step guards (tag check and checksum
    sweep) / wall time)."""
    g = s.extra["guard"]
    if not _ok(s) or not s.ttft_p50 or math.isnan(s.ttft_p50):
        return NAN, NAN
    return (sum(g.get(k, 0.0) for k in TTFT_KINDS) / _ok(s) / s.ttft_p50,
            sum(g.get(k, 0.0) for k in STEP_KINDS) / s.wall_s)


def _ci_verdict(ci: tuple[float, float], limit: float) -> str:
    """A cost with a 95% interval against an upper limit: met only if the whole interval is under it."""
    m, hw = ci
    if math.isnan(m):
        return "not measured"
    if math.isnan(hw):
        return _verdict(m <= limit, "single run, no interval")
    if m + hw <= limit:
        return "**met** (whole interval)"
    if m - hw > limit:
        return "**missed** (whole interval)"
    return "**inconclusive** (the interval spans the limit)" + ("; mean under it" if m <= limit else "; mean over it")


def _verdict(ok: bool | None, note: str = "") -> str:
    if ok is None:
        return "not measured" + (f" ({note})" if note else "")
    return ("**met**" if ok else "**missed**") + (f" ({note})" if note else "")
