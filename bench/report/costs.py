"""Report sections on what pdserve's own machinery costs: guard time per request and step, the checksums
on/off A/B, the KV transfer against raw Mooncake, and the gateway's admission decision and over-long floods."""
from __future__ import annotations

import json
import math

from ..harness.stack import GUARD_KINDS, STEP_KINDS, TTFT_KINDS
from ..harness.workload import Summary, fmt_ci, mean_ci, t975
from .format import NAN, _div, _hist_quantile, _median, _ms, _ms2, _ok, _pct, _table, guard_fractions


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
        L += _series_table(ab)
        guard_ttft, guard_thr, guard_ttft_cell, guard_thr_cell = _guard_shares(ab)
        if guard_ttft_cell is not None or guard_thr_cell is not None:
            L += ["Guard share, checksums-on stack of the A/B, mean ± 95% t-interval: "
                  + "; ".join(x for x in (
                      guard_ttft_cell and f"of TTFT p50 **{fmt_ci(*guard_ttft[:2], scale=100, unit='%')}** (prompt "
                      f"{guard_ttft_cell.prompt_len} × concurrency 1, the series' guard time per request over each "
                      f"request's TTFT, {guard_ttft[2]} requests)",
                      guard_thr_cell and f"of output throughput **{fmt_ci(*guard_thr[:2], scale=100, unit='%')}** "
                      f"(prompt {guard_thr_cell.prompt_len} × concurrency {guard_thr_cell.concurrency}, per-step "
                      f"guard seconds over each run's wall time, {guard_thr[2]} runs)") if x) + ".", ""]
        guard_ttft, guard_thr = guard_ttft[:2], guard_thr[:2]
    return L, (guard_ttft, guard_thr, guard_ttft_cell, guard_thr_cell)


def _cells(ab: list[Summary]) -> list[list[Summary]]:
    """The A/B's runs by cell, in the order they ran."""
    cells: dict[int, list[Summary]] = {}
    for s in ab:
        cells.setdefault(s.extra.get("ab_cell", 0), []).append(s)
    return [cells[k] for k in sorted(cells)]


def _pairs(cell: list[Summary]) -> list[dict[bool, Summary]]:
    """Complete pairs, on and off, neither with a failed request."""
    pairs: dict[int, dict[bool, Summary]] = {}
    for s in cell:
        pairs.setdefault(s.extra["pair"], {})[s.extra["checksums"]] = s
    return [p for _, p in sorted(pairs.items()) if len(p) == 2 and not p[True].num_errors and not p[False].num_errors]


def _series(cell: list[Summary], checksums: bool) -> dict | None:
    """One flag's series counters over the cell, summed over its halves (a stack restarted between them)."""
    found = [s.extra["series"] for s in cell if s.extra["checksums"] == checksums and "series" in s.extra]
    return _sum_counters(found) if found else None


def _sum_counters(xs: list):
    if isinstance(xs[0], dict):
        return {k: _sum_counters([x[k] for x in xs if k in x]) for k in dict.fromkeys(k for x in xs for k in x)}
    return sum(xs)


def _guard_shares(ab: list[Summary]) -> tuple[tuple, tuple, Summary | None, Summary | None]:
    """(guard share of TTFT at concurrency 1, of output throughput at the loaded cell), each (mean, half-width,
    n), from the checksums-on stack: the TTFT guards' seconds per request of the series over each request's TTFT;
    per run, the per-step guards' seconds over its wall time (those runs are read around each)."""
    ttft = thr = (NAN, NAN, 0)
    ttft_cell = thr_cell = None
    for cell in _cells(ab):
        on = [s for s in cell if s.extra["checksums"] and not s.num_errors]
        series = _series(cell, True)
        if not on:
            continue
        if on[0].concurrency == 1 and series and series["first_tokens"]:
            per_req = sum(series["guard"].get(k, 0.0) for k in TTFT_KINDS) / series["first_tokens"]
            xs = [per_req / s.ttft_p50 for s in on if s.ttft_p50 > 0]
            ttft, ttft_cell = (*mean_ci(xs), len(xs)), on[0]
        elif on[0].concurrency > 1 and all("guard" in s.extra for s in on):
            xs = [guard_fractions(s)[1] for s in on]
            thr, thr_cell = (*mean_ci(xs), len(xs)), on[0]
    return ttft, thr, ttft_cell, thr_cell


def _us_quantiles(series: dict, kind: str) -> str:
    """p50 / p90 of one per-step guard's calls, interpolated in the histogram's buckets (50 µs wide at the
    bottom: a coarse figure, there to show whether the mean is typical or carried by a few preempted calls)."""
    b = series.get("step_buckets", {}).get(kind)
    if not b:
        return "n/a"
    return f"{_hist_quantile(b, 0.5) * 1e6:.0f} / {_hist_quantile(b, 0.9) * 1e6:.0f}"


def _series_table(ab: list[Summary]) -> list[str]:
    """Each A/B stack's series as pdserve_guard_seconds counted it: the guards' exact in-process time."""
    rows = []
    for cell in _cells(ab):
        for checksums in (True, False):
            x = _series(cell, checksums)
            if not x:
                continue
            g, steps, req = x["guard"], max(x["steps"], 1), max(x["first_tokens"], 1)
            c0 = cell[0]
            rows.append([c0.prompt_len, c0.concurrency, "on" if checksums else "off", int(x["first_tokens"]),
                         int(x["steps"]),
                         f"{g['step_tag_check'] / steps * 1e6:.1f}", _us_quantiles(x, "step_tag_check"),
                         f"{g['checksum_sweep'] / steps * 1e6:.1f}", _us_quantiles(x, "checksum_sweep"),
                         f"{x['step_forward_s'] / steps * 1e3:.2f}",
                         _pct(sum(g[k] for k in STEP_KINDS) / x["step_forward_s"]) if x["step_forward_s"] else "n/a",
                         _ms2(sum(g[k] for k in TTFT_KINDS) / req), _ms2(g["checksum"] / req),
                         _ms2(g["prompt_verify"] / req),
                         f"{sum(v for k, v in x['cpu'].items()) / req * 1e3:.1f}"])
    if not rows:
        return []
    return ["The A/B's series, per stack (`pdserve_guard_seconds` and the processes' CPU time, read before and "
            "after each stack's whole series): the per-step guards in µs per decode step and against the step's "
            "forward pass (the quantiles per call: the sweep runs before every `--checksum-sweep-every`-th step), the guards before the first token per request. The tag check runs on both stacks; "
            "off has no transfer checksums, so no CRC-32C at prefill or verification and no sweep.", ""] + _table(
        ["prompt", "conc", "checksums", "requests", "steps", "tag check µs/step", "tag check p50 / p90 µs",
         "sweep µs/step", "sweep call p50 / p90 µs",
         "forward ms/step", "per-step guards / forward", "TTFT guards ms/req", "CRC-32C prefill ms/req",
         "prompt verify ms/req", "stack CPU ms/req"], rows)


def slot_model(xs: list[float], signs: list[int]) -> tuple[float, float, float, float, list[float]]:
    """x = effect + sign × slot + noise, sign +1 where the on stack held slot A, −1 where it held B: the
    effect and the slot term, each with the half-width of its 95% t-interval, from the two groups' means and
    the pooled spread around them (n − 2 degrees of freedom); and each x with its slot term removed. With one
    group only the slot cannot be told apart: the plain mean and interval, slot nan."""
    up = [x for x, g in zip(xs, signs) if g > 0]
    down = [x for x, g in zip(xs, signs) if g < 0]
    if not up or not down:
        m, h = mean_ci(xs)
        return m, h, math.nan, math.nan, list(xs)
    mu, md = sum(up) / len(up), sum(down) / len(down)
    effect, slot = (mu + md) / 2, (mu - md) / 2
    n = len(xs)
    if n < 3:
        h = math.nan
    else:
        var = (sum((x - mu) ** 2 for x in up) + sum((x - md) ** 2 for x in down)) / (n - 2)
        h = t975(n - 2) * math.sqrt(var / 4 * (1 / len(up) + 1 / len(down)))
    return effect, h, slot, h, [x - g * slot for x, g in zip(xs, signs)]


def _relative(pairs: list[dict[bool, Summary]], value) -> tuple[tuple, tuple, list[float]]:
    """on/off − 1 of value over the pairs, the slot term removed: ((effect, half-width), (slot A vs B,
    half-width), each pair's on/off − 1 without its slot term). Fitted on log ratios, where a slot that slows
    one stack by a factor cancels exactly between the halves (on plain ratios +20 % and −17 % would leave
    +1.7 %); half-widths are the log interval's, mapped back and halved. With one half only, the plain mean of
    the ratios − 1 and its interval."""
    ratios = [value(p[True]) / value(p[False]) for p in pairs]
    signs = [1 if p[True].extra.get("slot", 0) == 0 else -1 for p in pairs]
    if all(r > 0 for r in ratios):
        e, h, sl, hs, adj = slot_model([math.log(r) for r in ratios], signs)
        if not math.isnan(sl):
            rel = (lambda m, w: (math.expm1(m), (math.exp(m + w) - math.exp(m - w)) / 2))
            return rel(e, h), rel(sl, hs), [math.expm1(x) for x in adj]
    return mean_ci([r - 1 for r in ratios]), (math.nan, math.nan), [r - 1 for r in ratios]


def checksum_ab(ab: list[Summary]) -> tuple[list[str], dict]:
    """Checksums on vs off, paired, the stack slots' own difference removed; the effects per concurrency feed
    the targets."""
    L: list[str] = []
    ab_effects = {}
    if ab:
        L += ["## A/B: transfer checksums on vs off (`--no-transfer-checksum` on prefill and decode), paired", ""]
        L += ["Off also turns decode's checksum sweep off (it compares with the transfer checksums), so the "
              "difference is the CRC-32C at prefill, at prompt verification and in the per-step sweep together; "
              "the per-step tag check runs on both. Two stacks up side by side; each pair sends the same new "
              "prompts to one, then the other, alternating which goes first. At concurrency 1 a pair is one "
              "request; above, one closed-loop run of the cell's requests; tok/s is output tokens over the "
              "request's or the run's wall time. Two identical stacks differ by themselves (start order, ports, "
              "where the scheduler puts their processes), so the pairs run in two halves with the flags swapped "
              "between the two stack slots (both stacks restarted, each with the other flag): on − off is the "
              "mean of the two halves' paired differences, fitted on log ratios, and *slot A vs B* is the "
              "difference between the slots themselves that this removes (half the halves' difference). "
              "Intervals are 95% t-intervals from the pairs' spread around their half's mean; the medians are "
              "of the pairs with their slot term removed; *order*: the mean of first − second, relative, which "
              "the alternation cancels from the on − off mean. A run with one half only cannot separate the "
              "slot (its *slot* columns read n/a) and its on − off holds it. The guards' own seconds above have "
              "no such term.", ""]
        rows = []
        for cell in _cells(ab):
            full = _pairs(cell)
            if not full:
                continue
            c0 = cell[0]
            n, c = c0.prompt_len, c0.concurrency
            thr = (lambda s: s.out_tok_s)
            d_thr, slot_thr, xs_thr = _relative(full, thr)
            d_ttft, slot_ttft, xs_ttft = _relative(full, lambda s: s.ttft_p50)
            signs = [1 if p[True].extra.get("slot", 0) == 0 else -1 for p in full]
            d_ms, h_ms = slot_model([p[True].ttft_p50 - p[False].ttft_p50 for p in full], signs)[:2]
            order = mean_ci([(p[True].ttft_p50 / p[False].ttft_p50 - 1) * (1 if p[True].extra["first"] else -1)
                             for p in full])
            ab_effects[c] = (d_thr, d_ttft, n)
            rows.append([n, c, c0.num_requests, len(full), len(cell) // 2 - len(full),
                         f"{signs.count(1)} / {signs.count(-1)}",
                         fmt_ci(*mean_ci([thr(p[True]) for p in full]), digits=0),
                         fmt_ci(*mean_ci([thr(p[False]) for p in full]), digits=0),
                         fmt_ci(*d_thr, scale=100, unit="%"), _pct(_median(xs_thr)),
                         _ms(_median([p[True].ttft_p50 for p in full])),
                         _ms(_median([p[False].ttft_p50 for p in full])),
                         fmt_ci(*d_ttft, scale=100, unit="%"), _pct(_median(xs_ttft)),
                         fmt_ci(d_ms, h_ms, scale=1e3, unit=" ms"),
                         fmt_ci(*slot_ttft, scale=100, unit="%"), fmt_ci(*slot_thr, scale=100, unit="%"),
                         fmt_ci(*order, scale=100, unit="%")])
        L += _table(["prompt", "conc", "requests/pair", "pairs", "pairs dropped (errors)",
                     "pairs with on in slot A / B", "on tok/s", "off tok/s",
                     "Δ tok/s", "Δ tok/s median", "on TTFT p50 ms (median)", "off TTFT p50 ms (median)",
                     "Δ TTFT p50", "Δ TTFT median", "Δ TTFT ms", "slot A vs B, TTFT", "slot A vs B, tok/s",
                     "order: first vs second, TTFT"], rows)
    return L, ab_effects


def transfer_table(res: dict) -> list[str]:
    """In-service KV transfer against the write step alone and raw Mooncake (back to back and paced)."""
    L: list[str] = []
    tr_rows = res["transfer"]["cells"]
    if tr_rows:
        L += ["## KV transfer against raw Mooncake", ""]
        L += ["*in service*: prefill's `pdserve_kv_transfer_seconds` (it times the whole write step: zeroing the "
              "last page's tail, CRC-32C of every page, building tags, the data write, the tag write) for each request "
              "of the probe (sent one at a time, max_tokens 2, the metrics read around each: one exact sample per "
              "transfer); median and mean over them. *write step alone*: the same `PrefillWorker.write` in the "
              "benchmark process into a peer process, nothing else running. *raw*: `batch_transfer_sync_write` of "
              "the same bytes (one data run, then one tag run), process to process, back to back, and *paced*: each "
              "write after an idle gap as long as the probe's mean time to first token (at most 100 ms), as a service "
              "that transfers once per request sees it; medians of repeats. The target is judged on the in-service "
              "median against raw back to back, the stable floor; raw paced is shown but swung from 1.0 to 7.3 ms "
              "for the same 0.5 MB between runs on this machine.", ""]
        rows = []
        for t in tr_rows:
            b, wp = t["bytes"], t.get("write_path", {})
            parts = ", ".join(f"{k} {v * 100:.0f}%" for k, v in sorted(wp.get("parts", {}).items(),
                                                                      key=lambda kv: -kv[1]))
            med = t.get("median_s", t.get("p50_s", NAN))
            paced = t.get("raw_paced_s", NAN)
            rows.append([t["preset"], t["prompt_len"], "on" if t["checksums"] else "off", t.get("num_transfers", ""),
                         f"{b / 1e6:.2f}", _ms2(med), _ms2(t["pdserve_s"]), f"{b / med / 1e9:.2f}",
                         _ms2(wp.get("median_s", NAN)), f"{b / wp['median_s'] / 1e9:.2f}" if wp else "n/a",
                         _ms2(t["raw_s"]), f"{b / t['raw_s'] / 1e9:.2f}", _ms2(paced), _pct(paced / med),
                         _pct(t["raw_s"] / med), _pct(t["raw_s"] / wp["median_s"]) if wp else "n/a", parts or "n/a"])
        L += _table(["preset", "prompt", "checksums", "transfers", "MB/request", "in service median ms",
                     "in service mean ms", "in service median GB/s", "write step alone ms", "write step alone GB/s",
                     "raw back to back ms", "raw GB/s", "raw paced ms", "in service / raw paced",
                     "in service / raw back to back", "write step alone / raw back to back",
                     "write step by function (cProfile)"], rows)
        sweep = res["transfer"]["raw_sweep"]
        if sweep:
            L += ["Raw Mooncake by entry size (one entry, one batch call, up to the write unit): " + ", ".join(
                f"{s['bytes'] >> 10} KiB {s['bytes'] / s['median_s'] / 1e9:.2f} GB/s" for s in sweep) + ".", ""]
    return L


def admission_and_flood(res: dict) -> tuple[list[str], tuple[float, float]]:
    """Admission decision latency, over-long flood capacity and what a flood costs admitted traffic."""
    L: list[str] = []
    adm = res["admission"]
    if adm:
        L += ["## Gateway admission", ""]
        L += ["The decision itself: `GatewayServicer.admit` (tokenize when given text, vocabulary, sampling and "
              "length checks against the stack's capacity), timed in a separate process that imports what the "
              "gateway imports. *CPU*: the thread's own CPU time per decision, which leaves out time the thread was "
              "preempted by other processes.", ""]
        L += _table(["request", "p50 µs", "p99 µs", "max µs", "CPU p50 µs", "CPU p99 µs"],
                    [[k, f"{v['p50'] * 1e6:.0f}", f"{v['p99'] * 1e6:.0f}", f"{v['max'] * 1e6:.0f}",
                      f"{v.get('cpu_p50', NAN) * 1e6:.0f}", f"{v.get('cpu_p99', NAN) * 1e6:.0f}"] for k, v in adm.items()])
    fl = res["flood"]
    slow = slow_ttft = (NAN, NAN)
    if fl:
        cap, pairs, c = fl["capacity"], fl["pairs"], fl["cell"]
        slow = mean_ci([1 - p["flood"]["out_tok_s"] / p["alone"]["out_tok_s"] for p in pairs])
        slow_ttft = mean_ci([p["flood"]["ttft_p50"] / p["alone"]["ttft_p50"] - 1 for p in pairs])
        rate = mean_ci([p["flood_stats"]["rejected_per_s"] for p in pairs])
        per_rej = cap.get("gateway_cpu_per_rejection", NAN)
        L += [f"Over-long flood ({fl['prompt_len']}-token prompts, one more than the context) from a separate "
              f"client process: closed-loop capacity **{cap['rejected_per_s']:.0f} rejections/s** (16 clients, "
              f"codes {cap['codes']}), round trip p50 {cap['lat_p50'] * 1e3:.2f} ms, p99 {cap['lat_p99'] * 1e3:.2f} ms; "
              f"the gateway spent {per_rej * 1e6:.0f} µs of CPU per rejection (≈ {_div(1, per_rej):.0f} rejections/s "
              f"per core) and the flood client {cap['client_cpu_s'] / max(cap['sent'], 1) * 1e6:.0f} µs per request "
              f"— on 2 cores the two share what is left. Admitted traffic (prompt {c['prompt_len']} × concurrency "
              f"{c['concurrency']}, {c['num_requests']} requests) alone vs under a flood paced at "
              f"{fl.get('rate', 1000):,.0f}/s "
              f"({fmt_ci(*rate, digits=0)} rejections/s reached), {len(pairs)} interleaved pairs: output throughput "
              f"lost **{fmt_ci(*slow, scale=100, unit='%')}**, TTFT p50 {fmt_ci(*slow_ttft, scale=100, unit='%')} "
              "higher.", ""]
        rows = [[i + 1, f"{p['alone']['out_tok_s']:.0f}", f"{p['flood']['out_tok_s']:.0f}",
                 _ms(p["alone"]["ttft_p50"]), _ms(p["flood"]["ttft_p50"]), f"{p['flood_stats']['rejected_per_s']:.0f}",
                 json.dumps(p["flood_stats"]["codes"])] for i, p in enumerate(pairs)]
        L += _table(["pair", "alone tok/s", "flooded tok/s", "alone TTFT p50 ms", "flooded TTFT p50 ms",
                     "rejections/s", "flood codes"], rows)
    return L, slow
