"""Report sections on latency against co-located: the main table, headline ratios and the paired TTFT gap."""
from __future__ import annotations

from .format import NAN, TTFT_GAP_SLACK_S, _div, _find, _hist_quantile, _median, _ms, _pct, _table, _x
from ..harness.workload import Summary, fmt_ci, mean_ci


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
