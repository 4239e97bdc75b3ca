"""Report section on the gateway's front door: the admission decision and over-long floods."""
from __future__ import annotations

import json

from .format import NAN, _div, _ms, _table
from ..harness.workload import fmt_ci, mean_ci


def admission_and_flood(res: dict) -> tuple[list[str], tuple[float, float]]:
    """Admission decision latency, over-long flood capacity and what a flood costs admitted traffic."""
    L: list[str] = []
    adm = res["admission"]
    if adm:
        L += ["## Gateway admission", ""]
        L += ["The decision itself: `GatewayServicer.admit` (tokenize when given text, vocabulary, sampling and "
              "length checks against the stack's capacity), timed in a separate process that imports what the "
              "gateway imports. *CPU*: the thread's own CPU time per decision, which leaves out time the thread was "
              "preempted by other processes.", ""]
        L += _table(["request", "p50 µs", "p99 µs", "max µs", "CPU p50 µs", "CPU p99 µs"],
                    [[k, f"{v['p50'] * 1e6:.0f}", f"{v['p99'] * 1e6:.0f}", f"{v['max'] * 1e6:.0f}",
                      f"{v.get('cpu_p50', NAN) * 1e6:.0f}", f"{v.get('cpu_p99', NAN) * 1e6:.0f}"] for k, v in adm.items()])
    fl = res["flood"]
    slow = slow_ttft = (NAN, NAN)
    if fl:
        cap, pairs, c = fl["capacity"], fl["pairs"], fl["cell"]
        slow = mean_ci([1 - p["flood"]["out_tok_s"] / p["alone"]["out_tok_s"] for p in pairs])
        slow_ttft = mean_ci([p["flood"]["ttft_p50"] / p["alone"]["ttft_p50"] - 1 for p in pairs])
        rate = mean_ci([p["flood_stats"]["rejected_per_s"] for p in pairs])
        per_rej = cap.get("gateway_cpu_per_rejection", NAN)
        L += [f"Over-long flood ({fl['prompt_len']}-token prompts, one more than the context) from a separate "
              f"client process: closed-loop capacity **{cap['rejected_per_s']:.0f} rejections/s** (16 clients, "
              f"codes {cap['codes']}), round trip p50 {cap['lat_p50'] * 1e3:.2f} ms, p99 {cap['lat_p99'] * 1e3:.2f} ms; "
              f"the gateway spent {per_rej * 1e6:.0f} µs of CPU per rejection (≈ {_div(1, per_rej):.0f} rejections/s "
              f"per core) and the flood client {cap['client_cpu_s'] / max(cap['sent'], 1) * 1e6:.0f} µs per request "
              f"— on 2 cores the two share what is left. Admitted traffic (prompt {c['prompt_len']} × concurrency "
              f"{c['concurrency']}, {c['num_requests']} requests) alone vs under a flood paced at "
              f"{fl.get('rate', 1000):,.0f}/s "
              f"({fmt_ci(*rate, digits=0)} rejections/s reached), {len(pairs)} interleaved pairs: output throughput "
              f"lost **{fmt_ci(*slow, scale=100, unit='%')}**, TTFT p50 {fmt_ci(*slow_ttft, scale=100, unit='%')} "
              "higher.", ""]
        rows = [[i + 1, f"{p['alone']['out_tok_s']:.0f}", f"{p['flood']['out_tok_s']:.0f}",
                 _ms(p["alone"]["ttft_p50"]), _ms(p["flood"]["ttft_p50"]), f"{p['flood_stats']['rejected_per_s']:.0f}",
                 json.dumps(p["flood_stats"]["codes"])] for i, p in enumerate(pairs)]
        L += _table(["pair", "alone tok/s", "flooded tok/s", "alone TTFT p50 ms", "flooded TTFT p50 ms",
                     "rejections/s", "flood codes"], rows)
    return L, slow
