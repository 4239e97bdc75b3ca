"""`pdserve bench [--quick]`: pdserve against a co-located engine, transformers and raw Mooncake, side by side.

One invocation, one checkpoint per preset, one request mix (seeded prompts, greedy, ignore_eos,
max_tokens 32, closed loop at each concurrency). For every cell the co-located engine and pdserve
run back to back, so background load drifts between systems as little as it can. Writes
bench/out/bench-<mode>.md (also printed) and .json, and PNG plots when matplotlib is installed; `make bench-commit`
copies the tables to bench/results/, the ones kept in git.
Also runnable as `python -m pdserve.bench.run [--quick] [--no-profile]`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .harness.common import _T0, RESULTS, ROOT, log
from .scenarios.preset import Bench


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.run", description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny preset only, a few cells and a short load sweep: ~4-5 minutes")
    p.add_argument("--no-profile", action="store_true", help="skip the py-spy profiles")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where every engine runs (pdserve's prefill and decode, co-located, transformers); "
                        "default: cuda when present, as the services choose")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: rebuild the table and plots from bench/out/bench-<mode>.json")
    return p.parse_args(argv)


def _write_plots(res: dict) -> None:
    try:
        from .report.plots import write_plots
    except ImportError as e:
        print(f"\nplots skipped: matplotlib is not installed ({e}); `.venv/bin/pip install matplotlib` "
              f"or `pip install -e '.[bench]'` adds them. The tables above are complete.", flush=True)
    else:
        for p in write_plots(res, RESULTS):
            log(f"wrote {os.path.relpath(p, ROOT)}")


def report_only(mode: str) -> int:
    from .harness import profile
    from .report.write import write_report

    path = os.path.join(RESULTS, f"bench-{mode}.json")
    if not os.path.exists(path):
        print(f"no {os.path.relpath(path, ROOT)}: run `pdserve bench{' --quick' if mode == 'quick' else ''}` first",
              file=sys.stderr)
        return 1
    with open(path) as f:
        res = json.load(f)
    for p in res.get("profiles", {}).values():  # the raw stacks may be summarised better than when they were taken
        if os.path.exists(os.path.join(ROOT, p["file"])):
            p.update({k: v for k, v in profile.summarize(os.path.join(ROOT, p["file"])).items()})
    write_report(res, RESULTS)
    _write_plots(res)
    return 0


def _device(asked: str | None) -> str:
    import torch

    if asked == "cuda" and not torch.cuda.is_available():
        raise SystemExit("pdserve bench --device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    return asked or ("cuda" if torch.cuda.is_available() else "cpu")


def main(args=None) -> int:
    if args is None:
        args = parse()
    if getattr(args, "report_only", False):
        return report_only("quick" if args.quick else "full")
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's glog: errors only on our stderr
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    os.chdir(ROOT)
    from pdserve.engine.heap import keep_freed_memory
    from pdserve.engine.runner import set_threads

    from .scenarios import plan as plans
    from .report.write import write_report

    plan = plans.quick() if getattr(args, "quick", False) else plans.full()
    # the same intra-op threads as each pdserve engine process (half the cores): engine against engine
    set_threads()
    log(keep_freed_memory())  # as each engine process does: its co-located peer keeps its buffers too
    log(f"pdserve bench ({plan.mode}): {', '.join(p.preset for p in plan.presets)}; "
        f"{sum(len(p.cells) for p in plan.presets)} cells × (co-located, pdserve) + transformers + raw Mooncake")
    for s in plan.skipped:
        log(f"skipping {s}")
    device = _device(getattr(args, "device", None))
    bench = Bench(plan, profile=not getattr(args, "no_profile", False), device=device)
    os.makedirs(RESULTS, exist_ok=True)
    rc = 0
    for pp in plan.presets:
        try:
            bench.run_preset(pp)
        except Exception as e:  # noqa: BLE001 - one preset failing still leaves the others' numbers
            msg = f"{pp.preset}: {type(e).__name__}: {e}"
            log(f"FAILED {msg}")
            bench.res["errors"].append(msg[:2000])
            rc = 1
    for step in (bench.transfer, bench.admission, bench.decode_step):
        try:
            step()
        except Exception as e:  # noqa: BLE001
            msg = f"{step.__name__}: {type(e).__name__}: {e}"
            log(f"FAILED {msg}")
            bench.res["errors"].append(msg[:2000])
            rc = 1
    bench.res["elapsed_s"] = time.perf_counter() - _T0
    md_path = write_report(bench.res, RESULTS)
    log(f"wrote {os.path.relpath(md_path, ROOT)} and its .json")
    _write_plots(bench.res)
    log(f"done in {time.perf_counter() - _T0:.0f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
