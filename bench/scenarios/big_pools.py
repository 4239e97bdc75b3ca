"""Bench step of the vLLM comparison: both systems at pools of 2,097,152 tokens (the issue's scale), for their
start-up time and memory per token."""
from __future__ import annotations

import os

from ..harness.common import log
from ..versus.systems import BIG_POOL, Pdserve, Vllm, checkpoint, measure, model_facts
from ..harness.workload import MAX_TOKENS, make_prompts


def big_pools(res: dict, results_dir: str) -> None:
    """Start-up time and memory per token with pools of 2,097,152 tokens on the long preset (bf16, a 1,048,576-token
    context): pdserve's prefill and decode pools, and a vLLM KV cache of as many tokens. Memory per token is the
    resident-memory growth over the same checkpoint's 32k row (smaller pools, a 65,536-token context), per token
    of pool added; both are read after one served request (a page never touched is not resident)."""
    path = checkpoint("long:bfloat16")
    facts = model_facts(path)
    context = facts["max_position_embeddings"]
    prompts = make_prompts(1024, 1, facts["vocab_size"])
    out = res.setdefault("big_pools", {"pool_tokens": BIG_POOL, "context": context,
                                       "kv_bytes_per_token": facts["kv_bytes_per_token"]})
    for name, start in (("pdserve", lambda: Pdserve(path, context, BIG_POOL, BIG_POOL)),
                        ("vLLM-CPU", lambda: Vllm(path, context, BIG_POOL, facts["kv_bytes_per_token"],
                                                  facts["dtype"], os.path.join(results_dir, "vllm-serve-big.log")))):
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
