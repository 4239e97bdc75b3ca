"""Report section on the targets: each goal with what was measured and a verdict (met, missed, inconclusive),
the decode step against its memory-bandwidth floor among them."""
from __future__ import annotations

from ..harness.workload import Summary, fmt_ci, mean_ci
from .format import NAN, TTFT_GAP_SLACK_S, _ci_verdict, _div, _find, _hist_quantile, _median, _ms, _table, _verdict
from .load import sweep_targets


FLOOD_TARGET = 5000  # over-long rejections/s (issue 12)


def targets(res: dict, runs: list[Summary], keys: list[tuple], gaps: dict[tuple, dict], guard: tuple,
            ab_effects: dict, slow: tuple[float, float]) -> list[str]:
    """The targets table, judged from the runs and from what the earlier sections derived."""
    guard_ttft, guard_thr, guard_ttft_cell, guard_thr_cell = guard
    tr_rows, adm, fl = res["transfer"]["cells"], res["admission"], res["flood"]
    L: list[str] = []
    T: list[list[str]] = []
    slack = f"{TTFT_GAP_SLACK_S * 1e3:g}"
    if guard_thr_cell is not None:
        T.append([f"guard overhead ≤ 1% of output throughput (prompt {guard_thr_cell.prompt_len} × "
                  f"concurrency {guard_thr_cell.concurrency})", fmt_ci(*guard_thr, scale=100, unit="%"),
                  _ci_verdict(guard_thr, 0.01)])
        T.append([f"guard overhead ≤ 2% of TTFT p50 (prompt {guard_ttft_cell.prompt_len} × concurrency "
                  f"{guard_ttft_cell.concurrency})", fmt_ci(*guard_ttft, scale=100, unit="%"),
                  _ci_verdict(guard_ttft, 0.02)])
    for c, (d_thr, d_ttft, n) in sorted(ab_effects.items()):
        # the cost of checksums: throughput lost (off → on) and TTFT added, each with its interval
        T.append([f"(A/B) checksums cost ≤ 1% of output tok/s (prompt {n} × concurrency {c})",
                  f"tok/s on vs off {fmt_ci(*d_thr, scale=100, unit='%')}", _ci_verdict((-d_thr[0], d_thr[1]), 0.01)])
        T.append([f"(A/B) checksums cost ≤ 2% of TTFT p50 (prompt {n} × concurrency {c})",
                  f"TTFT p50 on vs off {fmt_ci(*d_ttft, scale=100, unit='%')}", _ci_verdict(d_ttft, 0.02)])
    for t in tr_rows:
        # judged against raw back to back, the stable floor: paced raw writes (after an idle gap) swung from
        # 1.0 to 7.3 ms for the same 0.5 MB across runs on this machine, so they are shown, not judged on
        paced, med = t.get("raw_paced_s", NAN), t.get("median_s", t.get("p50_s", NAN))
        r = t["raw_s"] / med
        label = "" if t["checksums"] else ", --no-transfer-checksum stack"
        T.append([f"KV transfer ≥ 90% of raw Mooncake ({t['preset']}, prompt {t['prompt_len']}{label})",
                  f"{r * 100:.0f}% of raw back to back ({t['bytes'] / med / 1e9:.2f} vs "
                  f"{t['bytes'] / t['raw_s'] / 1e9:.2f} GB/s, medians); {paced / med * 100:.0f}% of raw paced "
                  f"({t['bytes'] / paced / 1e9:.2f} GB/s)", _verdict(r >= 0.9, "median vs raw back to back")])
    for preset, n, c in keys:
        pd, colo, hf = _find(runs, "pdserve", preset, n, c), _find(runs, "co-located", preset, n, c), \
            _find(runs, "transformers", preset, n)
        if not (pd and colo):
            continue
        if c >= 4:
            r = _div(pd.out_tok_s, colo.out_tok_s)
            T.append([f"pdserve output tok/s ≥ 1.0× co-located ({preset}, prompt {n}, concurrency {c})",
                      f"{r:.2f}×", _verdict(r >= 1.0)])
        if c == 16 and hf:
            r = _div(colo.out_tok_s, hf.out_tok_s)
            # batching shares decode steps, never a prompt's forward pass: with decode free, co-located could
            # at best finish a request per prefill, and transformers takes 1 / req_s per request
            pf = _div(colo.extra.get("prefill_s", NAN), colo.num_requests)
            ceil = _div(_div(1.0, hf.req_s), pf)
            T.append([f"co-located tok/s at concurrency 16 ≥ 3× transformers ({preset}, prompt {n})",
                      f"{r:.2f}× (ceiling if decode cost nothing: {ceil:.2f}× — one prefill is {_ms(pf)} ms "
                      f"of transformers' {_ms(_div(1.0, hf.req_s))} ms per request)", _verdict(r >= 3)])
        if c == 1 and not gaps:
            tr = _div(pd.extra["transfer_sum"], pd.extra["transfer_count"])
            d = pd.ttft_p50 - colo.ttft_p50
            T.append([f"TTFT p50 − co-located ≤ transfer + {slack} ms at concurrency 1 ({preset}, prompt {n})",
                      f"{d * 1e3:.1f} ms vs {tr * 1e3:.1f} + {slack} ms", _verdict(d <= tr + TTFT_GAP_SLACK_S)])
    for (preset, n, ck), g in sorted(gaps.items(), key=lambda kv: (kv[0][0] != "tiny", kv[0][1])):
        if ck:
            tp50 = _hist_quantile(g["buckets"], 0.5)
            T.append([f"TTFT p50 − co-located ≤ transfer + {slack} ms ({preset}, prompt {n}; paired, one at a "
                      "time)",
                      f"{_median(g['gap']) * 1e3:.1f} ms vs {tp50 * 1e3:.1f} + {slack} ms "
                      f"(mean gap {fmt_ci(*mean_ci(g['gap']), scale=1e3, digits=1)} ms)", _verdict(g["verdict"])])
    if adm:
        p99 = adm["all"]["p99"]
        T.append(["gateway admission decision p99 < 1 ms (wall clock)", f"{p99 * 1e6:.0f} µs", _verdict(p99 < 1e-3)])
        if "cpu_p99" in adm["all"]:
            c99 = adm["all"]["cpu_p99"]
            T.append(["… its own CPU time p99 < 1 ms (without preemption by other work)", f"{c99 * 1e6:.0f} µs",
                      _verdict(c99 < 1e-3)])
    if fl:
        cap = fl["capacity"]["rejected_per_s"]
        T.append([f"over-long prompts rejected at ≥ {FLOOD_TARGET:,}/s", f"{cap:.0f}/s (closed loop, alone)",
                  _verdict(cap >= FLOOD_TARGET)])
        reached = [p["flood_stats"]["rejected_per_s"] for p in fl["pairs"]]
        T.append([f"… while admitted traffic slows by ≤ 5% (flood paced at {fl.get('rate', 1000):,.0f}/s)",
                  f"tok/s {fmt_ci(*slow, scale=100, unit='%')} lower; {fmt_ci(*mean_ci(reached), digits=0)} "
                  "rejections/s reached", _ci_verdict(slow, 0.05)])
    T += sweep_targets(res)
    T += decode_step_targets(res)
    L += ["## Targets", ""]
    L += _table(["target", "measured", "verdict"], T)
    return L


TARGET_BATCH, TARGET_CONTEXT, TARGET_RATIO = 16, 1024, 2.0  # issue 12: within 2× of the floor at b16, c1024


def decode_step_section(res: dict) -> list[str]:
    ds = res.get("decode_step") or {}
    if "rows" not in ds:
        return []
    return ["## Decode step against its memory-bandwidth floor", "",
            f"`python -m pdserve.bench.scenarios.decode_step`'s own table (its rows also in `{ds['file']}`):", "",
            ds["table"], ""]


def decode_step_targets(res: dict) -> list[list[str]]:
    ds = res.get("decode_step") or {}
    label = (f"decode step ≤ {TARGET_RATIO:g}× its memory-bandwidth floor (batch {TARGET_BATCH}, "
             f"context {TARGET_CONTEXT})")
    if "rows" not in ds:
        why = ds.get("absent", "not run")
        return [[label, why, _verdict(None)]]
    row = next((r for r in ds["rows"] if r["batch"] == TARGET_BATCH and r["context"] == TARGET_CONTEXT), None)
    if row is None:
        got = sorted((r["batch"], r["context"]) for r in ds["rows"])
        return [[label, f"no batch {TARGET_BATCH} × context {TARGET_CONTEXT} row (has {got})", _verdict(None)]]
    return [[label, f"{row['ratio']:.2f}× ({row['step_ms']:.2f} ms vs floor {row['floor_ms']:.2f} ms)",
             _verdict(row["ratio"] <= TARGET_RATIO)]]
