"""The Markdown report: tables, headline ratios, where the time goes, and which targets are met."""
from __future__ import annotations

import json
import math
import os

from .stack import GUARD_KINDS, TTFT_KINDS
from .workload import Summary, fmt_ci, mean_ci

NAN = math.nan


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
    """(guard time before the first token, per request / TTFT p50; step tag checks / wall time)."""
    g = s.extra["guard"]
    if not _ok(s) or not s.ttft_p50 or math.isnan(s.ttft_p50):
        return NAN, NAN
    return sum(g.get(k, 0.0) for k in TTFT_KINDS) / _ok(s) / s.ttft_p50, g["step_tag_check"] / s.wall_s


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


def build(res: dict) -> str:
    runs = [Summary(**r) for r in res["runs"]]
    ab = [Summary(**r) for r in res["ab"]]
    L: list[str] = []
    h = res["host"]
    L += [f"# pdserve bench — {res['mode']} run, {res['started']}", ""]
    L += [f"Host: {h['cpus']} CPU cores ({h['machine']}), no GPU, Python {h['python']}; total bench time "
          f"{res.get('elapsed_s', 0):.0f} s. Checkpoints: "
          + ", ".join(f"{k} = `{v}`" for k, v in res.get("models", {}).items()) + ".", ""]
    L += ["Request mix: seeded random prompt token ids, greedy, ignore_eos, max_tokens "
          f"{res['max_tokens']}; a closed loop of *concurrency* clients, each sending its next request when its "
          "last one ends. Prompt 4064 is the \"4,096\" point: the context length (the checkpoints' "
          "max_position_embeddings) is 4,096 and prompt + max_tokens must fit in it. "
          "**pdserve**: broker, prefill, decode and gateway as separate processes on this machine, Mooncake tcp on "
          "loopback, the default stack (context 4096, page 16, prefill pool 8,192 / decode pool 32,768 tokens), "
          "load through the gateway's gRPC streaming API from the benchmark process. **co-located**: the same "
          "ModelRunner and sampler in one process, prefill-first continuous batching over one 32,768-token pool, "
          "no broker, no transfer, no tags, no RPC. **transformers**: `LlamaForCausalLM.generate`, one request "
          "at a time. Every engine process uses the same torch intra-op threads (half the cores: pdserve's "
          "default), so pdserve's prefill and decode can use two cores where co-located uses one — but the "
          "gateway, broker and client share the same two. TTFT is measured from the client's send; ITL is every "
          "gap between streamed tokens. Numbers on a 2-core machine shared with other work are noisy: read the "
          "intervals, not single figures.", ""]
    if res["skipped"]:
        L += ["Skipped (and why):"] + [f"- {s}" for s in res["skipped"]] + [""]
    if res["errors"]:
        L += ["Errors during the run:"] + [f"- `{e}`" for e in res["errors"]] + [""]

    keys = sorted({(s.preset, s.prompt_len, s.concurrency) for s in runs if s.system != "transformers"},
                  key=lambda k: (k[0] != "tiny", k[1], k[2]))

    # -- main table ---------------------------------------------------------------------------------------------
    L += ["## Latency and throughput", ""]
    rows = []
    for preset, n, c in keys:
        hf = _find(runs, "transformers", preset, n)
        colo = _find(runs, "co-located", preset, n, c)
        for system in ("co-located", "pdserve"):
            s = _find(runs, system, preset, n, c)
            if s is None:
                continue
            rows.append([preset, n, c, s.num_requests, system + (f" ({s.num_errors} errors)" if s.num_errors else ""),
                         _ms(s.ttft_p50), _ms(s.ttft_p99), _ms(s.itl_p50), _ms(s.itl_p99), f"{s.out_tok_s:.0f}",
                         f"{s.req_s:.2f}", _x(_div(s.out_tok_s, colo.out_tok_s)) if colo else "n/a",
                         _x(_div(s.out_tok_s, hf.out_tok_s)) if hf else "n/a",
                         "—" if system == "co-located" else _pct(s.extra.get("agree", NAN)),
                         f"{s.extra.get('other_cores', NAN):.2f}"])
        if c == 1 and hf is not None:
            rows.append([preset, n, "1 (serial)", hf.num_requests, "transformers", _ms(hf.ttft_p50),
                         _ms(hf.ttft_p99), _ms(hf.itl_p50), _ms(hf.itl_p99), f"{hf.out_tok_s:.0f}", f"{hf.req_s:.2f}",
                         _x(_div(hf.out_tok_s, colo.out_tok_s)) if colo else "n/a", "1.00×",
                         _pct(hf.extra.get("agree", NAN)), f"{hf.extra.get('other_cores', NAN):.2f}"])
    L += _table(["preset", "prompt", "conc", "n", "system", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                 "ITL p99 ms", "out tok/s", "req/s", "tok/s vs co-located", "tok/s vs transformers",
                 "same tokens as co-located", "other load (cores)"], rows)
    div = res.get("divergence", [])
    if div:
        L += ["Greedy outputs that part from the co-located engine's (first differing token of the 32; a near-tie "
              "in the arg-max shows up as a late, single divergence, a wrong KV page as an early one):", ""]
        L += [f"- {d['system']}, {d['preset']} prompt {d['prompt_len']}, request {d['request']}: token "
              f"{d['first_different_token']}" for d in div] + [""]
    L += ["*same tokens as co-located*: share of requests whose greedy output is token-for-token the co-located "
          "engine's for the same prompt (a content check, not only a status check). *other load*: cores kept busy "
          "during the run by processes that are not part of the measured system (other users of the machine, "
          "an idle stack): how contended that measurement was.", ""]

    # -- headline ratios ----------------------------------------------------------------------------------------
    L += ["## Headline ratios", ""]
    rows = []
    for preset, n, c in keys:
        pd, colo, hf = _find(runs, "pdserve", preset, n, c), _find(runs, "co-located", preset, n, c), \
            _find(runs, "transformers", preset, n)
        if not (pd and colo):
            continue
        e = pd.extra
        rows.append([preset, n, c, _x(_div(pd.out_tok_s, colo.out_tok_s)),
                     _x(_div(colo.out_tok_s, hf.out_tok_s)) if hf else "n/a",
                     _x(_div(pd.out_tok_s, hf.out_tok_s)) if hf else "n/a",
                     _ms(pd.ttft_p50 - colo.ttft_p50), _ms(_div(e["transfer_sum"], e["transfer_count"])),
                     _ms(pd.itl_p50 - colo.itl_p50)])
    L += _table(["preset", "prompt", "conc", "pdserve / co-located tok/s", "co-located / transformers tok/s",
                 "pdserve / transformers tok/s", "TTFT p50 pdserve − co-located ms", "KV transfer mean ms",
                 "ITL p50 pdserve − co-located ms"], rows)

    # -- paired TTFT gap ------------------------------------------------------------------------------------------
    gaps: dict[tuple, dict] = {}
    for r in res.get("probe", []):
        if r["num_errors"]:
            continue
        key = (r["preset"], r["prompt_len"], r["extra"]["checksums"])
        g = gaps.setdefault(key, {"gap": [], "pd": [], "colo": [], "buckets": {}, "tsum": 0.0, "tcount": 0.0})
        g["gap"].append(r["ttft_p50"] - r["extra"]["colocated_ttft"])
        g["pd"].append(r["ttft_p50"])
        g["colo"].append(r["extra"]["colocated_ttft"])
        g["tsum"] += r["extra"]["transfer_sum"]
        g["tcount"] += r["extra"]["transfer_count"]
        for le, v in r["extra"].get("transfer_buckets", {}).items():
            g["buckets"][le] = g["buckets"].get(le, 0.0) + v
    if gaps:
        L += ["## Time to first token against co-located, paired", ""]
        L += ["Requests one at a time (max_tokens 2), interleaved: the same prompt to co-located, then to pdserve "
              "(then to the --no-transfer-checksum stack), then the next prompt, so background load hits both sides "
              "of a pair alike. Transfer time is prefill's `pdserve_kv_transfer_seconds` over the same requests "
              "(p50 interpolated in its buckets).", ""]
        rows = []
        for (preset, n, ck), g in sorted(gaps.items(), key=lambda kv: (kv[0][0] != "tiny", kv[0][1], not kv[0][2])):
            tp50 = _hist_quantile(g["buckets"], 0.5)
            gp50 = _median(g["gap"])
            g["verdict"] = gp50 <= tp50 + 0.005
            rows.append([preset, n, "on" if ck else "off", len(g["gap"]), _ms(_median(g["colo"])), _ms(_median(g["pd"])),
                         _ms(gp50), fmt_ci(*mean_ci(g["gap"]), scale=1e3, digits=1), _ms(tp50),
                         _ms(_div(g["tsum"], g["tcount"])), _ms(tp50 + 0.005)])
        L += _table(["preset", "prompt", "checksums", "pairs", "co-located TTFT p50 ms", "pdserve TTFT p50 ms",
                     "gap p50 ms", "gap mean ± 95% ms", "transfer p50 ms", "transfer mean ms",
                     "limit: transfer p50 + 5 ms"], rows)

    # -- TTFT decomposition -------------------------------------------------------------------------------------
    rows = []
    for preset, n, c in keys:
        pd, colo = _find(runs, "pdserve", preset, n, c), _find(runs, "co-located", preset, n, c)
        if not pd or not colo or not _ok(pd):
            continue
        g, k = pd.extra["guard"], _ok(pd)
        gw = _mean_rpc(pd, "gateway.ttft")
        alloc = _mean_rpc(pd, "decode.Allocate")
        pre = _mean_rpc(pd, "prefill.Prefill")
        tr = _div(pd.extra["transfer_sum"], pd.extra["transfer_count"])
        bw, ew = g.get("begin_write_wait", g["begin_write_rpc"]) / k, g["end_write_rpc"] / k
        first = (g["prompt_verify"] + g["validate_rpc"]) / k
        fwd = _div(colo.extra.get("prefill_s", NAN), colo.num_requests)
        rows.append([preset, n, c, _ms(pd.ttft_mean), _ms(pd.ttft_mean - gw), _ms(gw), _ms(alloc), _ms(g["grant_rpc"] / k),
                     _ms(pre), _ms(bw), _ms(pre - bw - tr - ew), _ms(tr), _ms(ew), _ms(first),
                     _ms(gw - alloc - pre - first), _ms(colo.ttft_mean), _ms(fwd)])
    if rows:
        L += ["## Time to first token, taken apart (means in ms)", ""]
        L += ["From the client's clock, the gateway's `pdserve_time_to_first_token_seconds`, every service's "
              "server-side `pdserve_rpc_seconds{method}` and the guard histograms, all read before and after the "
              "run. *rest in the stack* = gateway TTFT − Allocate − Prefill − first-Decode guards: the gRPC hops "
              "gateway→decode→prefill→decode (serialisation, HTTP/2, event-loop scheduling) and the gateway's own "
              "work, and when the decode pool is full (4064 × 16, 1024 × 64) the gateway's wait for pages (Allocate "
              "retried; Grant then counts every attempt). Above concurrency 1 the Prefill column includes waiting for "
              "the prefill instance (one forward at a time) and Allocate waiting through a busy decode event loop. "
              "*BeginWrite wait*: KeepAlive + BeginWrite run during the forward pass; this is what prefill still "
              "waits for them after it. Co-located "
              "*forward* is its prefill time per request; its TTFT adds waiting behind other prefills and steps.", ""]
        L += _table(["preset", "prompt", "conc", "client TTFT", "client↔gateway", "gateway TTFT", "decode Allocate",
                     "… Grant RPC", "prefill Prefill", "… BeginWrite wait", "… forward + rest", "… transfer step",
                     "… EndWrite", "decode verify + Validate", "rest in the stack", "co-located TTFT",
                     "co-located forward"], rows)
        broker = []
        for preset, n, c in keys:
            pd = _find(runs, "pdserve", preset, n, c)
            if c != 1 or not pd or not _ok(pd):
                continue
            k = _ok(pd)
            for kind, method in (("grant_rpc", "Grant"), ("begin_write_rpc", "BeginWrite"),
                                 ("end_write_rpc", "EndWrite"), ("validate_rpc", "Validate"),
                                 ("release_rpc", "Release")):
                caller = pd.extra["guard"][kind] / k
                server = _mean_rpc(pd, f"broker.{method}")
                broker.append([preset, n, method, _ms2(caller), _ms2(server), _ms2(caller - server)])
        L += ["Each broker RPC as its caller waits for it and as the broker's handler spends it (concurrency 1):", ""]
        L += _table(["preset", "prompt", "RPC", "caller ms", "broker handler ms", "gRPC round trip ms"], broker)

    # -- CPU per request ------------------------------------------------------------------------------------------
    rows = []
    for preset, n, c in keys:
        pd, colo = _find(runs, "pdserve", preset, n, c), _find(runs, "co-located", preset, n, c)
        if not pd or not colo or "cpu" not in pd.extra or not _ok(pd):
            continue
        cpu, k = pd.extra["cpu"], _ok(pd)
        total = sum(cpu.values())
        ccpu = colo.extra.get("cpu_s", NAN)
        rows.append([preset, n, c] + [_ms(cpu.get(p, NAN) / k) for p in ("client", "gateway", "broker", "prefill",
                                                                          "decode")] +
                    [_ms(total / k), f"{total / pd.wall_s:.2f}", _ms(ccpu / colo.num_requests),
                     f"{ccpu / colo.wall_s:.2f}", _ms(colo.extra.get("prefill_s", NAN) / colo.num_requests),
                     _ms(_div(colo.extra.get("decode_s", NAN), colo.extra.get("steps", 0)))])
    if rows:
        L += ["## CPU per request", ""]
        L += ["CPU seconds (user + system, from /proc) each process spent during the run, per request, and cores "
              "kept busy (CPU seconds / wall seconds; this machine has "
              f"{h['cpus']}). The co-located columns split its wall time into prefill and decode steps.", ""]
        L += _table(["preset", "prompt", "conc", "client ms", "gateway ms", "broker ms", "prefill ms", "decode ms",
                     "pdserve total ms", "pdserve cores busy", "co-located ms", "co-located cores busy",
                     "co-located prefill ms/req", "co-located ms/decode step"], rows)

    # -- transfer -------------------------------------------------------------------------------------------------
    tr_rows = res["transfer"]["cells"]
    if tr_rows:
        L += ["## KV transfer against raw Mooncake", ""]
        L += ["*in service*: prefill's `pdserve_kv_transfer_bytes_total` / `pdserve_kv_transfer_seconds` (it times "
              "the whole write step: zeroing the last page's tail, CRC-32C of every page, building tags, the data "
              "write, the tag write) over a probe of requests sent one at a time (max_tokens 2); p50 is "
              "interpolated in the histogram's buckets (coarse), the mean is sum / count (sensitive to a few slow "
              "transfers when the machine is busy). *write step "
              "alone*: the same `PrefillWorker.write` in the benchmark process into a peer process, nothing else "
              "running. *raw*: `batch_transfer_sync_write` of the same bytes (one data run + one tag run), process "
              "to process, back to back (median of repeats) and *paced*: each write after an idle gap as long as the "
              "probe's mean time to first token (at most 100 ms), as a service that transfers once per request sees "
              "it (mean of 10). The target is judged on the in-service mean against raw paced: both are means "
              "over writes that find Mooncake idle.", ""]
        rows = []
        for t in tr_rows:
            b, wp = t["bytes"], t.get("write_path", {})
            parts = ", ".join(f"{k} {v * 100:.0f}%" for k, v in sorted(wp.get("parts", {}).items(),
                                                                      key=lambda kv: -kv[1]))
            p50 = t.get("p50_s", NAN)
            rows.append([t["preset"], t["prompt_len"], "on" if t["checksums"] else "off", t.get("num_transfers", ""),
                         f"{b / 1e6:.2f}", _ms2(t["pdserve_s"]), _ms2(p50), f"{b / p50 / 1e9:.2f}",
                         _ms2(wp.get("median_s", NAN)), f"{b / wp['median_s'] / 1e9:.2f}" if wp else "n/a",
                         _ms2(t["raw_s"]), f"{b / t['raw_s'] / 1e9:.2f}", _ms2(t.get("raw_paced_s", NAN)),
                         _pct(t["raw_s"] / p50), _pct(t["raw_s"] / t["pdserve_s"]),
                         _pct(t.get("raw_paced_s", NAN) / t["pdserve_s"]),
                         _pct(t["raw_s"] / wp["median_s"]) if wp else "n/a", parts or "n/a"])
        L += _table(["preset", "prompt", "checksums", "transfers", "MB/request", "in service mean ms",
                     "in service p50 ms", "in service p50 GB/s", "write step alone ms", "write step alone GB/s",
                     "raw ms", "raw GB/s", "raw paced ms", "in service p50 / raw", "in service mean / raw",
                     "in service mean / raw paced", "write step alone / raw",
                     "write step by function (cProfile)"], rows)
        sweep = res["transfer"]["raw_sweep"]
        if sweep:
            L += ["Raw Mooncake by entry size (one entry): " + ", ".join(
                f"{s['bytes'] >> 10} KiB {s['bytes'] / s['median_s'] / 1e9:.2f} GB/s" for s in sweep) + ".", ""]

    # -- guard overhead ---------------------------------------------------------------------------------------
    pd_runs = [s for s in runs if s.system == "pdserve"]
    guard_ttft = guard_thr = (NAN, NAN)
    guard_ttft_cell = guard_thr_cell = None
    if pd_runs:
        L += ["## Guard overhead", ""]
        L += ["From `pdserve_guard_seconds_sum{kind}` on prefill and decode, read before and after each run. "
              "*Before the first token*: Grant, the wait for BeginWrite once the forward pass is done (KeepAlive + "
              "BeginWrite run during the pass; their whole time, begin_write_rpc, is shown but not charged), CRC-32C "
              "(prefill), EndWrite, prompt-page verification (tags + CRC-32C, decode) and Validate, per request, as "
              "a share of TTFT p50. *Per step*: the tag check "
              "before every decode step, as a share of the run's wall time (it runs before each step for the whole "
              "batch, so this is the output throughput it costs). Release runs after the last token and is shown "
              "but not charged.", ""]
        rows = []
        for s in pd_runs:
            g, k = s.extra["guard"], max(_ok(s), 1)
            f_ttft, f_thr = guard_fractions(s)
            rows.append([s.preset, s.prompt_len, s.concurrency] +
                        [_ms2(g.get(kind, NAN) / k) for kind in GUARD_KINDS if kind != "step_tag_check"] +
                        [_ms(g["step_tag_check"]), _pct(f_ttft), _pct(f_thr)])
        L += _table(["preset", "prompt", "conc"] + [f"{k} ms/req" for k in GUARD_KINDS if k != "step_tag_check"] +
                    ["step_tag_check ms total", "share of TTFT p50", "share of wall (tok/s)"], rows)
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

    # -- checksum A/B -----------------------------------------------------------------------------------------
    ab_effects = {}
    if ab:
        L += ["## A/B: transfer checksums on vs off (`--no-transfer-checksum` on prefill and decode)", ""]
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

    # -- admission and flood ---------------------------------------------------------------------------------
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
              f"{c['concurrency']}, {c['num_requests']} requests) alone vs under a flood paced at 1,000/s "
              f"({fmt_ci(*rate, digits=0)} rejections/s reached), {len(pairs)} interleaved pairs: output throughput "
              f"lost **{fmt_ci(*slow, scale=100, unit='%')}**, TTFT p50 {fmt_ci(*slow_ttft, scale=100, unit='%')} "
              "higher.", ""]
        rows = [[i + 1, f"{p['alone']['out_tok_s']:.0f}", f"{p['flood']['out_tok_s']:.0f}",
                 _ms(p["alone"]["ttft_p50"]), _ms(p["flood"]["ttft_p50"]), f"{p['flood_stats']['rejected_per_s']:.0f}",
                 json.dumps(p["flood_stats"]["codes"])] for i, p in enumerate(pairs)]
        L += _table(["pair", "alone tok/s", "flooded tok/s", "alone TTFT p50 ms", "flooded TTFT p50 ms",
                     "rejections/s", "flood codes"], rows)

    # -- targets ----------------------------------------------------------------------------------------------
    T: list[list[str]] = []
    if guard_thr_cell is not None:
        T.append([f"guard overhead ≤ 1% of output throughput (prompt {guard_thr_cell.prompt_len} × "
                  f"concurrency {guard_thr_cell.concurrency})", fmt_ci(*guard_thr, scale=100, unit="%"),
                  _ci_verdict(guard_thr, 0.01)])
        T.append([f"guard overhead ≤ 1% of TTFT p50 (prompt {guard_ttft_cell.prompt_len} × concurrency "
                  f"{guard_ttft_cell.concurrency})", fmt_ci(*guard_ttft, scale=100, unit="%"),
                  _ci_verdict(guard_ttft, 0.01)])
    for c, (d_thr, d_ttft, n) in sorted(ab_effects.items()):
        # the cost of checksums: throughput lost (off → on) and TTFT added, each with its interval
        T.append([f"(A/B) checksums cost ≤ 1% of output tok/s (prompt {n} × concurrency {c})",
                  f"tok/s on vs off {fmt_ci(*d_thr, scale=100, unit='%')}", _ci_verdict((-d_thr[0], d_thr[1]), 0.01)])
        T.append([f"(A/B) checksums cost ≤ 1% of TTFT p50 (prompt {n} × concurrency {c})",
                  f"TTFT p50 on vs off {fmt_ci(*d_ttft, scale=100, unit='%')}", _ci_verdict(d_ttft, 0.01)])
    for t in tr_rows:
        paced = t.get("raw_paced_s", NAN)
        r = paced / t["pdserve_s"]
        label = "" if t["checksums"] else ", --no-transfer-checksum stack"
        T.append([f"KV transfer ≥ 90% of raw Mooncake ({t['preset']}, prompt {t['prompt_len']}{label})",
                  f"mean {r * 100:.0f}% of raw paced ({t['bytes'] / t['pdserve_s'] / 1e9:.2f} vs "
                  f"{t['bytes'] / paced / 1e9:.2f} GB/s); {t['raw_s'] / t['pdserve_s'] * 100:.0f}% of raw back to "
                  f"back ({t['bytes'] / t['raw_s'] / 1e9:.2f} GB/s)", _verdict(r >= 0.9, "mean vs paced")])
    for preset, n, c in keys:
        pd, colo, hf = _find(runs, "pdserve", preset, n, c), _find(runs, "co-located", preset, n, c), \
            _find(runs, "transformers", preset, n)
        if not (pd and colo):
            continue
        if c == 16:
            r = _div(pd.out_tok_s, colo.out_tok_s)
            T.append([f"pdserve tok/s at concurrency 16 ≥ 90% of co-located ({preset}, prompt {n})",
                      f"{r * 100:.0f}%", _verdict(r >= 0.9)])
            if hf:
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
            T.append([f"TTFT p50 − co-located ≤ transfer + 5 ms at concurrency 1 ({preset}, prompt {n})",
                      f"{d * 1e3:.1f} ms vs {tr * 1e3:.1f} + 5 ms", _verdict(d <= tr + 0.005)])
    for (preset, n, ck), g in sorted(gaps.items(), key=lambda kv: (kv[0][0] != "tiny", kv[0][1])):
        if ck:
            tp50 = _hist_quantile(g["buckets"], 0.5)
            T.append([f"TTFT p50 − co-located ≤ transfer + 5 ms ({preset}, prompt {n}; paired, one at a time)",
                      f"{_median(g['gap']) * 1e3:.1f} ms vs {tp50 * 1e3:.1f} + 5 ms "
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
        T.append(["over-long prompts rejected at ≥ 1,000/s", f"{cap:.0f}/s (closed loop, alone)", _verdict(cap >= 1000)])
        T.append(["… without slowing admitted traffic by more than 5%",
                  f"tok/s {fmt_ci(*slow, scale=100, unit='%')} lower", _ci_verdict(slow, 0.05)])
    L += ["## Targets", ""]
    L += _table(["target", "measured", "verdict"], T)

    # -- profiles ---------------------------------------------------------------------------------------------
    if res["profiles"]:
        L += ["## Where the time goes (py-spy)", ""]
        L += ["py-spy at 100 Hz on each process during one run. Each busy sample is charged to its deepest frame "
              "in pdserve's code (`services/…`, entry points skipped); a sample with none is shown as the library "
              "it sits in. *busy* = busy samples / (100 × the run's wall time): how much of the run a thread was running (idle and waiting threads "
              "excluded; several threads can be busy at once). Raw collapsed stacks are in the files named.", ""]
        for label, p in res["profiles"].items():
            top = "; ".join(f"`{w}` {share * 100:.0f}%" for w, share in p["top"]) or "no busy samples"
            busy = p["samples"] / (100 * p.get("seconds", 1))
            L.append(f"- **{label}** (busy {busy * 100:.0f}%, `{p['file']}`): {top}")
        L.append("")
    return "\n".join(L)


def write_report(res: dict, out_dir: str) -> str:
    md = build(res)
    base = os.path.join(out_dir, f"bench-{res['mode']}")
    with open(base + ".md", "w") as f:
        f.write(md + "\n")
    with open(base + ".json", "w") as f:
        json.dump({k: v for k, v in res.items() if k != "models_abs"}, f, indent=1, default=str)
    print("\n" + md, flush=True)
    return base + ".md"
