"""Report sections on load: the open-loop sweep (TTFT/ITL and goodput per offered load, and its target rows),
and guidellm's figures over HTTP beside pdserve's own client's over gRPC for the same load."""
from __future__ import annotations

import math

from ..harness.openloop import DEADLINE_FACTOR, SLO_FACTOR, goodput_ratio
from .format import _div, _ms, _pct, _table, _verdict, _x


def _n(x) -> str:
    return "n/a" if x is None else f"{x:.0f}"


def _prefill_cells(lv: dict) -> list[str]:
    """Prompts prefilled, how many of them no client received (prefilled − first tokens delivered: the caller
    gave up before or during the pass), prefill's own count of passes started for a gone caller, and drops."""
    pf, firsts = lv.get("prefill"), lv["first_tokens"]
    if pf is None:  # co-located drops a request whose client left before its pass, by construction
        return [str(lv["prefills"]), str(lv["prefills"] - firsts), "0 (dropped before the pass)", "—"]
    if not pf["counted"]:  # before prefill counts sequences, it ran one pass per prompt
        return [_n(pf["passes"]), _n(pf["passes"] - firsts), "not counted by this prefill", "not counted"]
    return [_n(pf["sequences"]), _n(pf["sequences"] - firsts), _n(pf["forward_for_gone"]),
            f"{_n(pf['dropped_deadline'])} / {_n(pf['dropped_cancelled'])}"]


def _sat(s: dict) -> str:
    errors = f", {s['num_errors']} of {s['num_requests']} refused or failed" if s["num_errors"] else ""
    return (f"{s['req_s']:.2f} req/s (TTFT p50 {_ms(s['ttft_p50'])} ms{errors}, other load "
            f"{s['extra'].get('other_cores', math.nan):.2f} cores)")


def sweep_section(res: dict) -> list[str]:
    sweeps = res.get("sweep", [])
    if not sweeps:
        return []
    L = ["## TTFT and ITL against offered load (open loop, Poisson arrivals)", ""]
    L += ["Each system's *saturation* is the req/s of a closed loop at high concurrency (below); each level sends "
          "a seeded Poisson schedule at a multiple of it (the same unit gaps scaled, the same prompts, co-located "
          "then pdserve back to back), every request at its time whether or not earlier ones finished, and TTFT "
          "counts from the scheduled send. *SLO*: TTFT ≤ "
          f"{SLO_FACTOR:g} × co-located's unloaded TTFT p50 at that prompt length (one request at a time), the same "
          f"for both systems; a client with no first token {DEADLINE_FACTOR:g} × SLO after its send gives up "
          "(pdserve: cancels its gRPC call; co-located: the engine drops it from its queue, as an engine does on "
          "a disconnect); a refusal (e.g. RESOURCE_EXHAUSTED) is an error, not retried. *good*: all tokens "
          "arrived and the first within the SLO; *goodput* = good / the level's "
          "wall time (first send to the last request's end or abandonment). TTFT and ITL percentiles are over "
          "requests that got a first token, so at overload read them with *gave up*. *… not delivered*: prompts "
          "prefilled − first tokens the clients received (work done for callers that gave up before or during "
          "their pass, or while it was moved). *forwards for gone callers*: "
          "prefill's `pdserve_prefill_forward_for_gone_total` (passes started for a caller already gone), read "
          "before the level and after prefill's backlog settled; *dropped*: `pdserve_prefill_dropped_total` by "
          "reason.", ""]
    for sw in sweeps:
        sat = sw["saturation"]
        L += [f"**{sw['preset']}, prompt {sw['prompt_len']}**: SLO {_ms(sw['slo_s'])} ms (co-located unloaded "
              f"TTFT p50 {_ms(sw['unloaded_ttft_s'])} ms), clients give up at {_ms(sw['deadline_s'])} ms; "
              "saturation (closed loop, concurrency "
              f"{sat['pdserve']['concurrency']}, {sat['pdserve']['num_requests']} requests): co-located "
              f"{_sat(sat['co-located'])}, pdserve {_sat(sat['pdserve'])}. A saturation measured while other work "
              "held the cores is low, and every level of that system is offered less than it claims: read the "
              "*other load* columns.", ""]
        rows = []
        for lv in sorted(sw["levels"], key=lambda lv: (lv["system"] != "pdserve", lv["multiple"])):
            s, g = lv["summary"], lv["goodput"]
            ratio = goodput_ratio([x for x in sw["levels"] if x["system"] == lv["system"]], lv["multiple"])
            rows.append([lv["system"], f"{lv['multiple']:g}×", f"{lv['rate']:.2f}", g["offered"], _ms(s["ttft_p50"]),
                         _ms(s["ttft_p99"]), _ms(s["itl_p50"]), _ms(s["itl_p99"]), g["finished"], g["gave_up"],
                         g["errors"], f"{g['good']} ({_pct(g['good_share'])})", f"{g['goodput_req_s']:.2f}",
                         _pct(ratio)] + _prefill_cells(lv) + [f"{lv.get('other_cores', math.nan):.2f}"])
        L += _table(["system", "load × sat", "offered req/s", "requests", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                     "ITL p99 ms", "finished", "gave up", "errors", "good", "goodput req/s", "goodput / at 1×",
                     "prompts prefilled", "… not delivered", "forwards for gone callers",
                     "dropped (deadline / cancelled)", "other load (cores)"],
                    rows)
        errs = [f"{lv['system']} {lv['multiple']:g}×: {lv['error_codes']} (first: `{lv['first_error']}`)"
                for lv in sw["levels"] if lv.get("first_error")]
        if errs:
            L += ["Errors other than giving up, by code: " + "; ".join(errs) + ".", ""]
    return L


def sweep_targets(res: dict) -> list[list[str]]:
    """Goodput at 4× (2× shown) against saturation, and forwards for gone callers, for pdserve."""
    T: list[list[str]] = []
    for sw in res.get("sweep", []):
        pd = [lv for lv in sw["levels"] if lv["system"] == "pdserve"]
        where = f"{sw['preset']}, prompt {sw['prompt_len']}, SLO {_ms(sw['slo_s'])} ms"
        r4, r2 = goodput_ratio(pd, 4.0), goodput_ratio(pd, 2.0)
        T.append([f"goodput at 4× saturation ≥ 90% of goodput at saturation ({where})",
                  f"4×: {_pct(r4)}, 2×: {_pct(r2)}", _verdict(None if math.isnan(r4) else r4 >= 0.9)])
        pf = [lv["prefill"] for lv in pd if "prefill" in lv]
        if pf and all(p["counted"] for p in pf):
            gone = sum(p["forward_for_gone"] for p in pf)
            dropped = sum(p["dropped_deadline"] + p["dropped_cancelled"] for p in pf)
            T.append([f"0 prefill forward passes for callers already gone ({where}, all levels)",
                      f"{gone:.0f} (dropped before their pass: {dropped:.0f})", _verdict(gone == 0)])
        else:
            undelivered = sum(lv["prefill"]["passes"] - lv["first_tokens"] for lv in pd if "prefill" in lv)
            T.append([f"0 prefill forward passes for callers already gone ({where}, all levels)",
                      "prefill does not count them (`pdserve_prefill_sequences_total` stayed 0 or absent while "
                      f"its forward passes ran); client side: {undelivered:.0f} prompts prefilled whose caller had "
                      "given up by its first token", _verdict(None)])
    return T


def guidellm_section(res: dict) -> list[str]:
    g = res.get("guidellm")
    if not g or not g["cells"]:
        return []
    L = ["## guidellm (an outside client) against pdserve's own", ""]
    L += [f"guidellm {g['version']} runs against the gateway's OpenAI `/v1/completions` (streaming, `ignore_eos`, "
          "`max_tokens` as below) with its synthetic dataset: prompts of a fixed token count in the checkpoint's own "
          "tokenizer, a closed loop of *concurrency* streams. Right after each, on the same stack, pdserve's own "
          "bench client sends the same load (seeded token-id prompts of the same length, the same output tokens, "
          "concurrency and request count) over the gateway's gRPC API. The gap between the two is the HTTP front "
          "and the client: guidellm's TTFT counts from its HTTP send to the first streamed text, so a token held "
          "back for an unfinished UTF-8 character arrives later there. *ITL* here is guidellm's: each request's "
          "mean gap, (last token − first) / (tokens − 1), taken the same way from pdserve's client (the tables "
          "above take every gap). *tokens per request*: what guidellm counted (prompt / output), to show the "
          "load matched. guidellm's worker processes share the machine's cores with the stack, where pdserve's "
          "client is one lighter process: on 2 cores part of the gap is the client's own CPU.", ""]
    rows = []
    for c in g["cells"]:
        gl, pd = c["guidellm"], c["pdserve"]
        errors = f"{gl['errored']} + {gl['incomplete']} incomplete" if gl["incomplete"] else gl["errored"]
        rows.append([c["preset"], c["prompt_len"], c["concurrency"], c["num_requests"], "guidellm (HTTP)",
                     _ms(gl["ttft_p50"]), _ms(gl["ttft_p99"]), _ms(gl["itl_p50"]), _ms(gl["itl_p99"]),
                     f"{gl['out_tok_s']:.0f}", f"{gl['req_s']:.2f}", errors,
                     f"{gl['prompt_tokens_p50']:.0f} / {gl['output_tokens_p50']:.0f}", _x(_div(gl["out_tok_s"],
                                                                                            pd["out_tok_s"]))])
        rows.append([c["preset"], c["prompt_len"], c["concurrency"], pd["num_requests"], "pdserve client (gRPC)",
                     _ms(pd["ttft_p50"]), _ms(pd["ttft_p99"]), _ms(pd["extra"]["itl_req_p50"]),
                     _ms(pd["extra"]["itl_req_p99"]),
                     f"{pd['out_tok_s']:.0f}", f"{pd['req_s']:.2f}", pd["num_errors"],
                     f"{c['prompt_len']} / {res['max_tokens']}", "1.00×"])
    L += _table(["preset", "prompt", "conc", "n", "client", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                 "out tok/s", "req/s", "errors", "tokens per request", "tok/s vs pdserve client"], rows)
    L += ["guidellm's own output: " + ", ".join(f"`{p}`" for p in sorted({c["output"] for c in g["cells"]})), ""]
    return L
