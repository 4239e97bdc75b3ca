"""The vLLM comparison's Markdown report (bench/out/vllm-<mode>.md, also printed), built from its JSON."""
from __future__ import annotations

import math
import os

GiB = 2**30


def pair_runs(runs: list[dict]) -> dict[tuple[str, int, int], tuple[dict, dict]]:
    """{(row, prompt, concurrency): (pdserve run, vLLM run)} for the cells both systems ran."""
    by = {(r["preset"], r["prompt_len"], r["concurrency"], r["system"]): r for r in runs}
    return {(row, p, c): (r, by[(row, p, c, "vLLM-CPU")]) for (row, p, c, s), r in by.items()
            if s == "pdserve" and (row, p, c, "vLLM-CPU") in by}


def _ms(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1e3:.1f}"


def _ratio(a, b) -> float:
    return a / b if a and b and not (math.isnan(a) or math.isnan(b)) else math.nan


def _x(r: float) -> str:
    return "n/a" if math.isnan(r) else f"{r:.2f}×"


def verdict(p: int, c: int, pd: dict, vl: dict) -> str:
    """The issue's target: output tok/s ≥ vLLM's at concurrency ≥ 4, TTFT p50 ≤ vLLM's at prompt ≥ 1,024. A cell
    where either system failed requests is not compared: the survivors' latencies would flatter it."""
    if pd["num_errors"] or vl["num_errors"]:
        failed = [f"{name} {s['num_errors']} of {s['num_requests']} failed" for name, s in (("pdserve", pd), ("vLLM", vl))
                  if s["num_errors"]]
        return f"MISSED ({', '.join(failed)})" if pd["num_errors"] else f"not compared ({', '.join(failed)})"
    parts = []
    if c >= 4:
        parts.append("tok/s met" if pd["out_tok_s"] >= vl["out_tok_s"] else "tok/s MISSED")
    if p >= 1024:
        parts.append("TTFT met" if pd["ttft_p50"] <= vl["ttft_p50"] else "TTFT MISSED")
    return ", ".join(parts) or "(no target)"


def latency_table(res: dict) -> list[str]:
    out = ["| checkpoint | prompt | conc. | req. | TTFT p50 / p90 ms pdserve | vLLM | TTFT p50 ratio | "
           "ITL ms p50: per-request mean / per gap, pdserve | vLLM | ratio (means) | output tok/s pdserve | vLLM | ratio | target | other load (cores) | interrupts (cores) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for (row, p, c), (pd, vl) in pair_runs(res["runs"]).items():
        out.append(f"| {row} | {p:,} | {c} | {pd['num_requests']} "
                   f"| {_ms(pd['ttft_p50'])} / {_ms(pd['extra']['ttft_p90'])} "
                   f"| {_ms(vl['ttft_p50'])} / {_ms(vl['extra']['ttft_p90'])} "
                   f"| {_x(_ratio(pd['ttft_p50'], vl['ttft_p50']))} "
                   f"| {_ms(pd['extra']['itl_req_p50'])} / {_ms(pd['itl_p50'])} "
                   f"| {_ms(vl['extra']['itl_req_p50'])} / {_ms(vl['itl_p50'])} "
                   f"| {_x(_ratio(pd['extra']['itl_req_p50'], vl['extra']['itl_req_p50']))} "
                   f"| {pd['out_tok_s']:.1f} | {vl['out_tok_s']:.1f} | {_x(_ratio(pd['out_tok_s'], vl['out_tok_s']))} "
                   f"| {verdict(p, c, pd, vl)} "
                   f"| {pd['extra']['other_cores']:.2f} / {vl['extra']['other_cores']:.2f} "
                   f"| {pd['extra'].get('irq_cores', math.nan):.2f} / {vl['extra'].get('irq_cores', math.nan):.2f} |")
    return out


def cpu_table(res: dict) -> list[str]:
    out = ["| checkpoint | prompt | conc. | CPU s / request pdserve (4 processes) | vLLM (its process group) |",
           "|---|---:|---:|---:|---:|"]
    for (row, p, c), (pd, vl) in pair_runs(res["runs"]).items():
        out.append(f"| {row} | {p:,} | {c} | {pd['extra']['cpu_s_per_request']:.3f} "
                   f"| {vl['extra']['cpu_s_per_request']:.3f} |")
    return out


def tokens_table(res: dict) -> list[str]:
    out = ["| checkpoint | prompt | conc. | requests with identical token ids | tokens equal (same position) "
           "| first divergence |", "|---|---:|---:|---:|---:|---:|"]
    for t in res["tokens"]:
        first = "none" if t["first_divergence_min"] is None else f"token {t['first_divergence_min']}"
        failed = f" ({t['failed']} failed, not compared)" if t.get("failed") else ""
        out.append(f"| {t.get('row', '')} | {t['prompt_len']:,} | {t['concurrency']} "
                   f"| {t['identical']} / {t['requests']}{failed} "
                   f"| {t['tokens_equal']} / {t['tokens']} | {first} |")
    return out


def startup_lines(res: dict) -> list[str]:
    out = ["| checkpoint | system | start-up s | resident memory after start |", "|---|---|---:|---|"]
    for s in res["startup"]:
        rss = ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in s["rss"].items())
        out.append(f"| {s['row']} | {s['system']} | {s['startup_s']:.1f} | {rss} |")
    return out


def big_pool_lines(res: dict) -> list[str]:
    b = res.get("big_pools")
    if not b:
        return ["not measured in this mode (`--no-big-pools` or `--quick`)"]
    base = {s["system"]: s["rss"] for s in res["startup"] if s["row"] == "long (bf16)"}
    rows = {r["name"]: r for r in res["rows"]}
    small = rows.get("long (bf16)")
    out = [f"Pools of {b['pool_tokens']:,} tokens, context {b['context']:,}, long preset in bf16: nominal KV "
           f"{b['kv_bytes_per_token']:,} bytes a token ({b['pool_tokens'] * b['kv_bytes_per_token'] / GiB:.1f} GiB "
           f"a pool). Per token: resident growth over the 32k row's start (pools {small and small['prefill_pool']:,} "
           f"/ {small and small['decode_pool']:,}), divided by the tokens of pool added.", "",
           "| system | start-up s | served | resident after one request | bytes / pool token (measured) |",
           "|---|---:|---|---|---|"]
    for name in ("pdserve", "vLLM-CPU"):
        s = b.get(name)
        if s is None:
            continue
        if "startup_s" not in s:
            out.append(f"| {name} | did not start | | | {s['error'][:200]} |")
            continue
        rss = ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in s["rss_served"].items())
        per = []
        if small and name in base:
            grow = {"prefill": b["pool_tokens"] - small["prefill_pool"], "decode": b["pool_tokens"] - small["decode_pool"],
                    "vllm": b["pool_tokens"] - small["decode_pool"]}
            for k, v in s["rss_served"].items():
                if k in grow and k in base[name]:
                    per.append(f"{k} {(v - base[name][k]) / grow[k]:,.0f}")
        served = "yes" if s["served"] else f"no ({s['error']})"
        out.append(f"| {name} | {s['startup_s']:.1f} | {served} | {rss} | {', '.join(per) or 'n/a'} |")
    return out


def profile_lines(res: dict) -> list[str]:
    p = res.get("profile")
    if not p:
        return ["no profile (every cell met the target, or `--no-profile`)"]
    out = [f"py-spy, {p['row']}, prompt {p['prompt_len']:,} × concurrency {p['concurrency']} "
           f"({p['seconds']:.1f} s, {p['out_tok_s']:.1f} tok/s, TTFT p50 {_ms(p['ttft_p50'])} ms while sampled):"]
    for svc, s in p["services"].items():
        top = "; ".join(f"{where} {share:.0%}" for where, share in s["top"][:5])
        out.append(f"- {svc}: {s['samples']} busy samples ({s['idle']} idle): {top}")
    return out


def render(res: dict) -> str:
    lines = [f"# pdserve against {res['vllm']}, side by side ({res['mode']})", "",
             f"Same checkpoint, same seeded prompt token ids, the same streaming HTTP client (`/v1/completions`, "
             f"`stream: true`), greedy, ignore_eos, {res['max_tokens']} output tokens; one system after the other on "
             f"{res['cores']} cores. Ratios are pdserve / vLLM (TTFT and ITL: lower is better for pdserve; tok/s: "
             f"higher). Threads: pdserve {res['threads']['pdserve']}; vLLM {res['threads']['vLLM-CPU']}.", "",
             *latency_table(res), "", "CPU per request:", "", *cpu_table(res), "",
             "Greedy outputs, pdserve against vLLM, the same prompts:", "", *tokens_table(res), "",
             "Start-up:", "", *startup_lines(res), "", "## Pools of 2,097,152 tokens", "", *big_pool_lines(res), "",
             "## Where pdserve's time goes at a missed cell", "", *profile_lines(res)]
    for s in res["startup"]:
        if s["system"] == "vLLM-CPU" and s.get("log_lines"):
            lines += ["", f"vLLM's own start-up lines ({s['row']}):", "", "```", *s["log_lines"][:8], "```"]
            break
    if res["errors"]:
        lines += ["", "## Errors", "", *[f"- {e[:500]}" for e in res["errors"]]]
    return "\n".join(lines) + "\n"


def write_report(res: dict, results_dir: str) -> str:
    text = render(res)
    print(text, flush=True)
    path = os.path.join(results_dir, f"vllm-{res['mode']}.md")
    with open(path, "w") as f:
        f.write(text)
    return path
