"""The Markdown report: tables, headline ratios, where the time goes, and which targets are met."""
from __future__ import annotations

import json
import os

from .costs import admission_and_flood, checksum_ab, guard_overhead, transfer_table
from .format import guard_fractions
from .latency import cpu_per_request, headline_ratios, latency_table, paired_gap, profiles, ttft_breakdown
from .load import guidellm_section, sweep_section
from .targets import decode_step_section, targets
from ..harness.workload import Summary

__all__ = ["build", "guard_fractions", "write_report"]


def intro(res: dict) -> list[str]:
    """The title, the host, what each system is, and anything skipped or failed."""
    L: list[str] = []
    h = res["host"]
    L += [f"# pdserve bench — {res['mode']} run, {res['started']}"
          + (f", commit `{res['commit']}`" if "commit" in res else ""), ""]
    gpu = h.get("device", "cpu")
    gpu = "no GPU" if gpu == "cpu" else f"engines on {gpu}"
    L += [f"Host: {h['cpus']} CPU cores ({h['machine']}), {gpu}, Python {h['python']}; total bench time "
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
    return L


def build(res: dict) -> str:
    """The whole report, section by section, in order; later sections reuse what earlier ones derived."""
    runs = [Summary(**r) for r in res["runs"]]
    ab = [Summary(**r) for r in res["ab"]]
    L = intro(res)
    keys = sorted({(s.preset, s.prompt_len, s.concurrency) for s in runs if s.system != "transformers"},
                  key=lambda k: (k[0] != "tiny", k[1], k[2]))
    L += latency_table(res, runs, keys)
    L += headline_ratios(runs, keys)
    L += guidellm_section(res)
    lines, gaps = paired_gap(res)
    L += lines
    L += ttft_breakdown(runs, keys)
    L += cpu_per_request(res, runs, keys)
    L += transfer_table(res)
    lines, guard = guard_overhead(runs, ab)
    L += lines
    lines, ab_effects = checksum_ab(ab)
    L += lines
    lines, slow = admission_and_flood(res)
    L += lines
    L += sweep_section(res)
    L += decode_step_section(res)
    L += targets(res, runs, keys, gaps, guard, ab_effects, slow)
    L += profiles(res)
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
