"""Report sections on what pdserve's own machinery costs: guard time per request and step, the checksums
on/off A/B, the KV transfer against raw Mooncake, and the gateway's admission decision and over-long floods."""
from __future__ import annotations

import json

from ..harness.stack import GUARD_KINDS, STEP_KINDS
from ..harness.workload import Summary, fmt_ci, mean_ci
from .format import NAN, _div, _ms, _ms2, _ok, _pct, _table, guard_fractions


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
