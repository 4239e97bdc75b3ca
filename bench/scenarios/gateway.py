"""Bench steps at the gateway's front door: over-long floods (capacity and cost to admitted traffic) and the
admission decision timed on its own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict

from ..harness.common import RESULTS, ROOT, ensure_model, log, under_flood

FLOOD_RATE = 5000  # over-long prompts/s beside the admitted traffic: issue 12's target rate


class GatewaySteps:
    """Bench methods on the gateway; mixed into Bench (uses its plan, profile flag and res)."""

    def _flood(self, pp, stack, vocab) -> None:
        from .plan import CONTEXT
        from ..harness.stack import cpu_seconds
        from ..harness.workload import make_prompts

        over = CONTEXT + 1
        cmd = [sys.executable, "-u", "-m", "pdserve.bench.scenarios.flood", stack.gateway, "--prompt-len", str(over)]
        gw_pid = stack.pids()["gateway"]
        log(f"{pp.preset}: over-long flood ({over}-token prompts): capacity, 16 closed-loop clients, "
            f"{self.plan.flood_seconds:.1f} s")
        spy = None
        if self.profile:
            from ..harness import profile

            pdir = os.path.join(RESULTS, "profiles")
            os.makedirs(pdir, exist_ok=True)
            spy_path = os.path.join(pdir, f"{self.plan.mode}-{pp.preset}-flood-gateway.txt")
            spy = profile.start(gw_pid, self.plan.flood_seconds + 2, spy_path)
            time.sleep(0.5)
        cpu0 = cpu_seconds(gw_pid)
        out = subprocess.run(cmd + ["--seconds", str(self.plan.flood_seconds), "--concurrency", "16"],
                             capture_output=True, text=True, cwd=ROOT, timeout=120, stdin=subprocess.DEVNULL)
        gw_cpu = cpu_seconds(gw_pid) - cpu0
        lines = [ln for ln in out.stdout.strip().splitlines() if '"ready"' not in ln]
        if not lines:
            raise RuntimeError(f"flood printed nothing: {out.stderr[-2000:]}")
        cap = json.loads(lines[-1])
        cap["gateway_cpu_s"] = gw_cpu
        cap["gateway_cpu_per_rejection"] = gw_cpu / max(cap["rejected"], 1)
        if spy is not None:
            from ..harness import profile

            profile.stop(spy)
            summary = profile.summarize(spy_path)
            summary.update(file=os.path.relpath(spy_path, ROOT), cell={"prompt_len": over, "concurrency": 16},
                           seconds=cap["wall_s"])
            self.res["profiles"][f"{pp.preset} over-long flood gateway"] = summary
        log(f"  {cap['rejected_per_s']:.0f} rejections/s, round trip p50 {cap['lat_p50'] * 1e3:.2f} ms "
            f"p99 {cap['lat_p99'] * 1e3:.2f} ms, codes {cap['codes']}; gateway CPU "
            f"{cap['gateway_cpu_per_rejection'] * 1e6:.0f} µs per rejection, flood client CPU "
            f"{cap['client_cpu_s'] / max(cap['sent'], 1) * 1e6:.0f} µs per request")
        cell = pp.flood
        prompts = make_prompts(cell.prompt_len, cell.num_requests, vocab)
        pairs = []
        log(f"{pp.preset}: admitted traffic (prompt {cell.prompt_len} × concurrency {cell.concurrency}) alone vs "
            f"under a {FLOOD_RATE:,}/s over-long flood, {self.plan.repeats} interleaved pairs")
        for i in range(self.plan.repeats):
            alone, _ = stack.run("pdserve", pp.preset, prompts, cell.concurrency)
            (loaded, _), fl = under_flood(cmd + ["--rate", str(FLOOD_RATE), "--seconds", "120", "--concurrency",
                                                 "128", "--stop-on-stdin"],
                                          lambda: stack.run("pdserve+flood", pp.preset, prompts, cell.concurrency))
            pairs.append({"alone": asdict(alone), "flood": asdict(loaded), "flood_stats": fl})
            log(f"  pair {i + 1}: alone {alone.out_tok_s:.0f} tok/s, TTFT p50 {alone.ttft_p50 * 1e3:.1f} ms | "
                f"flooded {loaded.out_tok_s:.0f} tok/s, TTFT p50 {loaded.ttft_p50 * 1e3:.1f} ms, "
                f"{fl['rejected_per_s']:.0f} rejections/s {fl['codes']}")
        self.res["flood"] = {"capacity": cap, "pairs": pairs, "prompt_len": over, "cell": asdict(cell),
                           "rate": FLOOD_RATE}

    def admission(self) -> None:
        out = subprocess.run([sys.executable, "-m", "pdserve.bench.scenarios.admission", ensure_model("tiny"),
                              str(self.plan.admission_iters)], capture_output=True, text=True, cwd=ROOT, timeout=300)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        res = json.loads(out.stdout.strip().splitlines()[-1])
        self.res["admission"] = res
        log(f"gateway admission decision (GatewayServicer.admit, in a gateway-sized process): "
            f"p50 {res['all']['p50'] * 1e6:.0f} µs, p99 {res['all']['p99'] * 1e6:.0f} µs "
            f"(thread CPU time p99 {res['all']['cpu_p99'] * 1e6:.0f} µs)")
