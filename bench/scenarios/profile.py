"""Bench step: py-spy on pdserve's four services and on the co-located engine during one run of a cell."""
from __future__ import annotations

import os
import time
from dataclasses import asdict

from ..harness.common import RESULTS, ROOT, _short, log


class ProfileStep:
    """The py-spy profiles; mixed into Bench (uses its plan, res and matrix results)."""

    def _profile(self, pp, stack, colo, vocab) -> None:
        from ..harness import profile
        from ..harness.workload import MAX_TOKENS, make_prompts

        if profile.pyspy_path() is None:
            msg = "profiles skipped: py-spy is not installed (`.venv/bin/pip install py-spy`)"
            log(msg)
            self.res["errors"].append(msg)
            return
        pdir = os.path.join(RESULTS, "profiles")
        os.makedirs(pdir, exist_ok=True)
        for cell in pp.profile:
            prompts = make_prompts(cell.prompt_len, cell.num_requests, vocab)
            est = next((r["wall_s"] * cell.num_requests / r["num_requests"] for r in self.res["runs"]
                        if r["system"] == "pdserve" and r["preset"] == pp.preset and r["prompt_len"] == cell.prompt_len
                        and r["concurrency"] == cell.concurrency), 10.0)
            secs = est * 1.5 + 2
            log(f"{pp.preset}: py-spy, prompt {cell.prompt_len} × concurrency {cell.concurrency} "
                f"({cell.num_requests} requests): pdserve's four services, then the co-located engine")
            name = f"{self.plan.mode}-{pp.preset}-{cell.prompt_len}x{cell.concurrency}"
            spies = {}
            for svc, pid in stack.pids().items():
                path = os.path.join(pdir, f"{name}-{svc}.txt")
                spies[svc] = (profile.start(pid, secs, path), path)
            time.sleep(0.5)  # py-spy attaches
            s, _ = stack.run("pdserve (profiled)", pp.preset, prompts, cell.concurrency)
            for p, _ in spies.values():
                profile.stop(p)
            path = os.path.join(pdir, f"{name}-co-located.txt")
            spy = profile.start(os.getpid(), secs, path)
            time.sleep(0.5)
            _, colo_wall = colo.run(prompts, cell.concurrency, MAX_TOKENS)
            profile.stop(spy)
            spies["co-located"] = (spy, path)
            for svc, (_, path) in spies.items():
                summary = profile.summarize(path)
                summary.update(file=os.path.relpath(path, ROOT), cell=asdict(cell),
                               seconds=colo_wall if svc == "co-located" else s.wall_s)
                self.res["profiles"][f"{pp.preset} {cell.prompt_len}×{cell.concurrency} {svc}"] = summary
            log(f"  profiled pdserve run: {_short(s)}")
