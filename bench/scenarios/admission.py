"""The gateway's admission decision, timed on its own: `python -m pdserve.bench.scenarios.admission MODEL_DIR ITERS`.

A separate process that imports only what the gateway imports, so the benchmark's own heap (torch,
transformers, a loaded model) does not put its garbage-collection pauses into the percentiles.
Prints one JSON object: p50/p99/max seconds (wall, and thread CPU time) per kind of request and overall.
"""
from __future__ import annotations

import json
import sys
import time

from pdserve.client import build_request
from pdserve.common.errors import PdError
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.gateway.router import Backend
from pdserve.gateway.servicer import Capacity, GatewayServicer

from ..harness.workload import make_prompts, percentile

CONTEXT = 4096
VOCAB = 512


def measure(model_dir: str, iters: int) -> dict:
    gw = GatewayServicer([Backend("prefill", None)], [Backend("decode", None)], load_tokenizer(model_dir, VOCAB),
                         Capacity("bench", CONTEXT, VOCAB, 16, 2048, 8192))
    text = ("The quick brown fox jumps over the lazy dog. Requests arrive, wait in a queue, and leave "
            "with their answers. ") * 6
    cases = {f"{n} token ids": build_request(prompt_token_ids=make_prompts(n, 1, VOCAB)[0], max_tokens=32)
             for n in (128, 1024, CONTEXT - 32)}
    cases[f"text, {len(text)} chars"] = build_request(prompt=text, max_tokens=32)
    cases[f"over-long: {CONTEXT + 1} token ids (rejected)"] = build_request(
        prompt_token_ids=make_prompts(CONTEXT + 1, 1, VOCAB)[0], max_tokens=32)
    out = {}
    all_t: list[float] = []
    all_c: list[float] = []  # thread CPU time: the decision's own cost, without time preempted by other work
    for name, req in cases.items():
        for _ in range(20):  # warm-up
            try:
                gw.admit(req)
            except PdError:
                pass
        ts, cs = [], []
        for _ in range(iters):
            c = time.thread_time()
            t = time.perf_counter()
            try:
                gw.admit(req)
            except PdError:
                pass
            ts.append(time.perf_counter() - t)
            cs.append(time.thread_time() - c)
        all_t += ts
        all_c += cs
        out[name] = {"p50": percentile(ts, 50), "p99": percentile(ts, 99), "max": max(ts),
                     "cpu_p50": percentile(cs, 50), "cpu_p99": percentile(cs, 99)}
    out["all"] = {"p50": percentile(all_t, 50), "p99": percentile(all_t, 99), "max": max(all_t),
                  "cpu_p50": percentile(all_c, 50), "cpu_p99": percentile(all_c, 99)}
    return out


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]))), flush=True)
