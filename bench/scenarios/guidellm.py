"""Bench step: guidellm against the stack's `/v1/completions`, then pdserve's own gRPC client with the same load
(prompt length, output tokens, concurrency, request count) on the same stack, so the two clients' figures sit
side by side in the report."""
from __future__ import annotations

import importlib.metadata
import os
from dataclasses import asdict
from itertools import groupby

from ..harness.common import RESULTS, ROOT, log


class GuidellmStep:
    """The guidellm comparison; mixed into Bench (uses its plan and res)."""

    def _guidellm(self, pp, stack, model_dir, vocab) -> None:
        from ..peers import guidellm
        from ..harness.workload import MAX_TOKENS, make_prompts, percentile

        try:
            version = importlib.metadata.version("guidellm")
        except importlib.metadata.PackageNotFoundError:
            msg = "guidellm skipped: it is not installed (`pip install -e '.[bench]'` adds it)"
            log(msg)
            self.res["errors"].append(msg)
            return
        out_dir = os.path.join(RESULTS, "guidellm")
        os.makedirs(out_dir, exist_ok=True)
        http_port = stack.procs["gateway"][0].http_port
        target = f"http://127.0.0.1:{http_port}"
        cells = sorted(pp.guidellm, key=lambda c: (c.prompt_len, c.concurrency))
        entry = self.res.setdefault("guidellm", {"version": version, "cells": []})
        for prompt_len, group in groupby(cells, key=lambda c: c.prompt_len):
            group = list(group)
            base = os.path.join(out_dir, f"{self.plan.mode}-{pp.preset}-prompt{prompt_len}")
            spec = guidellm.scenario(target, model_dir, prompt_len, MAX_TOKENS, [c.concurrency for c in group],
                                     [c.num_requests for c in group], base + ".json")
            log(f"{pp.preset}: guidellm {version} on {target}/v1/completions, synthetic prompts of {prompt_len} "
                f"tokens, {MAX_TOKENS} output tokens, concurrency {', '.join(str(c.concurrency) for c in group)}")
            results = guidellm.run(spec, base + "-scenario.json", timeout_s=300 + 30 * sum(c.num_requests
                                                                                          for c in group))
            ran = [g["concurrency"] for g in results]
            if ran != [c.concurrency for c in group]:
                raise guidellm.GuidellmError(f"guidellm ran concurrencies {ran}, asked for "
                                             f"{[c.concurrency for c in group]}")
            for cell, g in zip(group, results):
                prompts = make_prompts(prompt_len, cell.num_requests, vocab, seed=3)
                own, records = stack.run("pdserve client", pp.preset, prompts, cell.concurrency)
                # guidellm's ITL is each request's mean gap, (last token - first) / (tokens - 1): the same here
                means = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in records
                         if r.error is None and len(r.token_times) > 1]
                own.extra.update(itl_req_p50=percentile(means, 50), itl_req_p99=percentile(means, 99))
                err = f", {g['errored']} errors ({g['first_error']})" if g["errored"] else ""
                log(f"  concurrency {cell.concurrency}, TTFT p50 / ITL p50 (per-request mean) / output tok/s: "
                    f"guidellm {g['ttft_p50'] * 1e3:.1f} / {g['itl_p50'] * 1e3:.1f} ms / {g['out_tok_s']:.0f}{err}; "
                    f"pdserve client {own.ttft_p50 * 1e3:.1f} / {own.extra['itl_req_p50'] * 1e3:.1f} ms / "
                    f"{own.out_tok_s:.0f}" + (f", {own.num_errors} errors" if own.num_errors else ""))
                entry["cells"].append({"preset": pp.preset, "prompt_len": prompt_len,
                                       "concurrency": cell.concurrency, "num_requests": cell.num_requests,
                                       "guidellm": g, "pdserve": asdict(own),
                                       "output": os.path.relpath(base + ".json", ROOT)})
