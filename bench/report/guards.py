"""Report sections on what the guards cost: guard time per request and step, and the checksums on/off A/B."""
from __future__ import annotations

from .format import NAN, _ms, _ms2, _ok, _pct, _table, guard_fractions
from ..harness.stack import GUARD_KINDS, STEP_KINDS
from ..harness.workload import Summary, fmt_ci, mean_ci


def guard_overhead(runs: list[Summary], ab: list[Summary]) -> tuple[list[str], tuple]:
    """Guard time per request and per step; over the A/B's checksums-on runs, its share with an interval."""
    L: list[str] = []
    pd_runs = [s for s in runs if s.system == "pdserve"]
    guard_ttft = guard_thr = (NAN, NAN)
    guard_ttft_cell = guard_thr_cell = None
    if pd_runs:
        L += ["## Guard overhead", ""]
        L += ["From `pdserve_guard_seconds_sum{kind}` on prefill and decode, read before and after each run. "
              "*Before the first token*: Grant, the wait for BeginWrite once the forward pass is done (BeginWrite, "
              "which also starts the write's liveness, runs during the pass; their whole time, begin_write_rpc, is shown but not charged), CRC-32C "
              "(prefill), EndWrite, prompt-page verification (tags + CRC-32C, decode) and Validate (0 on the Run path: the broker's write-done notice stands for it), per request, as "
              "a share of TTFT p50. *Per step*: the tag check "
              "and the checksum sweep (CRC-32C of up to `--checksum-sweep-pages` prompt pages, default 8) before every "
              "decode step, as a share of the run's wall time (they run before each step for the whole batch, so "
              "this is the output throughput they cost). Release runs after the last token and is shown "
              "but not charged.", ""]
        rows = []
        for s in pd_runs:
            g, k = s.extra["guard"], max(_ok(s), 1)
            f_ttft, f_thr = guard_fractions(s)
            rows.append([s.preset, s.prompt_len, s.concurrency] +
                        [_ms2(g.get(kind, NAN) / k) for kind in GUARD_KINDS if kind not in STEP_KINDS] +
                        [_ms(g.get(kind, NAN)) for kind in STEP_KINDS] +
                        [_pct(g.get("checksum_sweep", NAN) / s.wall_s), _pct(f_ttft), _pct(f_thr)])
        L += _table(["preset", "prompt", "conc"] + [f"{k} ms/req" for k in GUARD_KINDS if k not in STEP_KINDS] +
                    [f"{k} ms total" for k in STEP_KINDS] +
                    ["sweep share of wall", "share of TTFT p50", "share of wall (tok/s)"], rows)
        on = [s for s in ab if s.extra.get("checksums")]
        if on:
            c1 = [s for s in on if s.concurrency == min(x.concurrency for x in on)]
            cn = [s for s in on if s.concurrency == max(x.concurrency for x in on)]
            guard_ttft = mean_ci([guard_fractions(s)[0] for s in c1])
            guard_thr = mean_ci([guard_fractions(s)[1] for s in cn])
            guard_ttft_cell, guard_thr_cell = c1[0], cn[0]
            L += [f"Over the repeated checksums-on runs of the A/B, mean ± 95% t-interval: guard share of TTFT p50 "
                  f"**{fmt_ci(*guard_ttft, scale=100, unit='%')}** ({len(c1)} runs, prompt {c1[0].prompt_len} × "
                  f"concurrency {c1[0].concurrency}); of output throughput "
                  f"**{fmt_ci(*guard_thr, scale=100, unit='%')}** ({len(cn)} runs, prompt {cn[0].prompt_len} × "
                  f"concurrency {cn[0].concurrency}).", ""]
    return L, (guard_ttft, guard_thr, guard_ttft_cell, guard_thr_cell)


def checksum_ab(ab: list[Summary]) -> tuple[list[str], dict]:
    """Transfer checksums on vs off over interleaved pairs; the effects per concurrency feed the targets."""
    L: list[str] = []
    ab_effects = {}
    if ab:
        L += ["## A/B: transfer checksums on vs off (`--no-transfer-checksum` on prefill and decode)", ""]
        L += ["Off also turns decode's checksum sweep off (it compares with the transfer checksums), so the "
              "difference is the CRC-32C at prefill, at prompt verification and in the per-step sweep together; "
              "the sweep's own time is in the guard-overhead table.", ""]
        L += ["Two stacks up side by side, runs interleaved on, off, on, off, …; the difference is on − off, "
              "relative to off, as mean ± 95% t-interval over the pairs.", ""]
        cells = sorted({(s.prompt_len, s.concurrency, s.num_requests) for s in ab}, key=lambda x: x[1])
        rows = []
        for n, c, num in cells:
            pairs: dict[int, dict[bool, Summary]] = {}
            for s in ab:
                if s.prompt_len == n and s.concurrency == c:
                    pairs.setdefault(s.extra["pair"], {})[s.extra["checksums"]] = s
            full = [p for p in pairs.values() if len(p) == 2]
            d_thr = mean_ci([p[True].out_tok_s / p[False].out_tok_s - 1 for p in full])
            d_ttft = mean_ci([p[True].ttft_p50 / p[False].ttft_p50 - 1 for p in full])
            d_ttft_ms = mean_ci([p[True].ttft_p50 - p[False].ttft_p50 for p in full])
            ab_effects[c] = (d_thr, d_ttft, n)
            on_thr = mean_ci([p[True].out_tok_s for p in full])
            off_thr = mean_ci([p[False].out_tok_s for p in full])
            rows.append([n, c, num, len(full), fmt_ci(*on_thr, digits=0), fmt_ci(*off_thr, digits=0),
                         fmt_ci(*d_thr, scale=100, unit="%"),
                         fmt_ci(*mean_ci([p[True].ttft_p50 for p in full]), scale=1e3, digits=1),
                         fmt_ci(*mean_ci([p[False].ttft_p50 for p in full]), scale=1e3, digits=1),
                         fmt_ci(*d_ttft, scale=100, unit="%"), fmt_ci(*d_ttft_ms, scale=1e3, unit=" ms")])
        L += _table(["prompt", "conc", "requests/run", "pairs", "on tok/s", "off tok/s", "Δ tok/s (on vs off)",
                     "on TTFT p50 ms", "off TTFT p50 ms", "Δ TTFT p50", "Δ TTFT p50 ms"], rows)
    return L, ab_effects
