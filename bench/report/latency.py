"""Report sections on latency and where it goes: the main table against co-located, headline ratios, the
paired TTFT gap, TTFT taken apart, broker RPCs, CPU per request and the py-spy profiles."""
from __future__ import annotations

from ..harness.workload import Summary, fmt_ci, mean_ci
from .format import (NAN, TTFT_GAP_SLACK_S, _div, _find, _hist_quantile, _mean_rpc, _median, _ms, _ms2, _ok, _pct,
                     _table, _x)


def latency_table(res: dict, runs: list[Summary], keys: list[tuple]) -> list[str]:
    """Latency and throughput of every system per cell, and where greedy outputs part from co-located."""
    L: list[str] = []
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
    return L


def headline_ratios(runs: list[Summary], keys: list[tuple]) -> list[str]:
    """Throughput ratios between the systems and pdserve's TTFT and ITL gaps to co-located."""
    L: list[str] = []
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
    return L


def paired_gap(res: dict) -> tuple[list[str], dict[tuple, dict]]:
    """TTFT against co-located from the paired one-at-a-time probe; the gaps (with verdicts) feed the targets."""
    L: list[str] = []
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
              "and to the --no-transfer-checksum stack (those two in alternating order: whichever goes first after "
              "co-located finds the machine idlest), then the next prompt, so background load hits both sides "
              "of a pair alike. Transfer time is prefill's `pdserve_kv_transfer_seconds` over the same requests "
              "(p50 interpolated in its buckets).", ""]
        rows = []
        for (preset, n, ck), g in sorted(gaps.items(), key=lambda kv: (kv[0][0] != "tiny", kv[0][1], not kv[0][2])):
            tp50 = _hist_quantile(g["buckets"], 0.5)
            gp50 = _median(g["gap"])
            g["verdict"] = gp50 <= tp50 + TTFT_GAP_SLACK_S
            rows.append([preset, n, "on" if ck else "off", len(g["gap"]), _ms(_median(g["colo"])), _ms(_median(g["pd"])),
                         _ms(gp50), fmt_ci(*mean_ci(g["gap"]), scale=1e3, digits=1), _ms(tp50),
                         _ms(_div(g["tsum"], g["tcount"])), _ms(tp50 + TTFT_GAP_SLACK_S)])
        L += _table(["preset", "prompt", "checksums", "pairs", "co-located TTFT p50 ms", "pdserve TTFT p50 ms",
                     "gap p50 ms", "gap mean ± 95% ms", "transfer p50 ms", "transfer mean ms",
                     f"limit: transfer p50 + {TTFT_GAP_SLACK_S * 1e3:g} ms"], rows)
    return L, gaps


def ttft_breakdown(runs: list[Summary], keys: list[tuple]) -> list[str]:
    """Time to first token taken apart by service and guard, and each broker RPC caller vs handler."""
    L: list[str] = []
    rows = []
    for preset, n, c in keys:
        pd, colo = _find(runs, "pdserve", preset, n, c), _find(runs, "co-located", preset, n, c)
        if not pd or not colo or not _ok(pd):
            continue
        g, k = pd.extra["guard"], _ok(pd)
        gw = _mean_rpc(pd, "gateway.ttft")
        alloc = g["grant_rpc"] / k  # Run sends the destination once Grant answers
        pre = _mean_rpc(pd, "prefill.Prefill")
        tr = _div(pd.extra["transfer_sum"], pd.extra["transfer_count"])
        bw, ew = g.get("begin_write_wait", g["begin_write_rpc"]) / k, g["end_write_rpc"] / k
        first = (g["prompt_verify"] + g["validate_rpc"]) / k
        fwd = _div(colo.extra.get("prefill_s", NAN), colo.num_requests)
        pd_fwd = _mean_rpc(pd, "prefill.forward")
        rows.append([preset, n, c, _ms(pd.ttft_mean), _ms(pd.ttft_mean - gw), _ms(gw), _ms(alloc),
                     _ms(pre), _ms(bw), _ms(pd_fwd), _ms(pre - bw - tr - ew - pd_fwd), _ms(tr), _ms(ew), _ms(first),
                     _ms(gw - alloc - pre - first), _ms(colo.ttft_mean), _ms(fwd)])
    if rows:
        L += ["## Time to first token, taken apart (means in ms)", ""]
        L += ["From the client's clock, the gateway's `pdserve_time_to_first_token_seconds`, every service's "
              "server-side `pdserve_rpc_seconds{method}` and the guard histograms, all read before and after the "
              "run. The path is decode's `Run` stream (Grant, then the destination), prefill's `Prefill` (BeginWrite "
              "during the forward pass, the write, EndWrite), the broker's write-done notice to decode, decode's "
              "prompt-page check, the first token. *rest in the stack* = gateway TTFT − Grant − Prefill − decode's "
              "check: the gRPC hops gateway→decode→gateway→prefill, the notice broker→decode, the first token "
              "decode→gateway (serialisation, HTTP/2, event-loop scheduling), the gateway's own work, and when the "
              "decode pool is full (4064 × 16, 1024 × 64) the wait in decode's queue for pages (Grant then counts "
              "every attempt). Above concurrency 1 the Prefill column includes waiting in prefill's queue. "
              "*BeginWrite wait*: BeginWrite runs during the forward pass; this is what prefill still "
              "waits for it after it. *forward*: `pdserve_forward_seconds{phase=\"prefill\"}`, timed in the thread "
              "that runs it; *rest*: the rest of the Prefill call (waiting for the one compute slot and local pages, "
              "handing the pass to its thread and back). Co-located "
              "*forward* is its prefill time per request; its TTFT adds waiting behind other prefills and steps.", ""]
        L += _table(["preset", "prompt", "conc", "client TTFT", "client↔gateway", "gateway TTFT", "decode Grant RPC",
                     "prefill Prefill", "… BeginWrite wait", "… forward", "… rest", "… transfer step",
                     "… EndWrite", "decode verify (+ Validate)", "rest in the stack", "co-located TTFT",
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
                if not caller:  # not on this path (Validate: the write-done notice stands for it)
                    continue
                broker.append([preset, n, method, _ms2(caller), _ms2(server), _ms2(caller - server)])
        L += ["Each broker RPC as its caller waits for it and as the broker's handler spends it (concurrency 1):", ""]
        L += _table(["preset", "prompt", "RPC", "caller ms", "broker handler ms", "gRPC round trip ms"], broker)
    return L


def cpu_per_request(res: dict, runs: list[Summary], keys: list[tuple]) -> list[str]:
    """CPU seconds per request by process, and cores kept busy, for pdserve and co-located."""
    L: list[str] = []
    h = res["host"]
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
                     _ms(_div(colo.extra.get("decode_s", NAN), colo.extra.get("steps", 0))),
                     _ms(_mean_rpc(pd, "prefill.forward")), _ms(_mean_rpc(pd, "decode.forward"))])
    if rows:
        L += ["## CPU per request", ""]
        L += ["CPU seconds (user + system, from /proc) each process spent during the run, per request, and cores "
              "kept busy (CPU seconds / wall seconds; this machine has "
              f"{h['cpus']}). The co-located columns split its wall time into prefill and decode steps; the last two "
              "are pdserve's own forward passes (`pdserve_forward_seconds`, timed in the thread that runs them): "
              "the same work, so a gap to co-located is time the pass lost to its neighbours on the machine.", ""]
        L += _table(["preset", "prompt", "conc", "client ms", "gateway ms", "broker ms", "prefill ms", "decode ms",
                     "pdserve total ms", "pdserve cores busy", "co-located ms", "co-located cores busy",
                     "co-located prefill ms/req", "co-located ms/decode step", "pdserve prefill ms/req",
                     "pdserve ms/decode step"], rows)
    return L


def profiles(res: dict) -> list[str]:
    """The py-spy summaries: where each process spent its busy samples."""
    L: list[str] = []
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
    return L
