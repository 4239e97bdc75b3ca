"""`pdserve bench [--quick]`: pdserve against a co-located engine, transformers and raw Mooncake, side by side.

One invocation, one checkpoint per preset, one request mix (seeded prompts, greedy, ignore_eos,
max_tokens 32, closed loop at each concurrency). For every cell the co-located engine and pdserve
run back to back, so background load drifts between systems as little as it can. Writes
bench/results/bench-<mode>.md (also printed) and .json, and PNG plots when matplotlib is installed.
Also runnable as `python -m bench.run [--quick] [--no-profile]`.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
MODELS = os.path.join(ROOT, "bench", ".models")
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


def _short(s) -> str:
    ms = lambda x: "n/a" if math.isnan(x) else f"{x * 1e3:.1f}"  # noqa: E731
    err = f", {s.num_errors} errors ({s.extra.get('first_error')})" if s.num_errors else ""
    return (f"{s.wall_s:.1f}s  TTFT p50 {ms(s.ttft_p50)} ms  ITL p50 {ms(s.itl_p50)} ms  "
            f"{s.out_tok_s:.0f} tok/s{err}")


def ensure_model(preset: str) -> str:
    from services.engine.make_model import make_model

    default = os.path.join(ROOT, "models", "pdserve-tiny")
    if preset == "tiny" and os.path.exists(os.path.join(default, "config.json")):
        return default
    path = os.path.join(MODELS, f"pdserve-{preset}")
    if not os.path.exists(os.path.join(path, "config.json")):
        log(f"writing the {preset} checkpoint to {os.path.relpath(path, ROOT)} (seed 0) ...")
        make_model(path, preset, 0)
    return path


class Bench:
    def __init__(self, plan, profile: bool):
        from .workload import MAX_TOKENS

        self.plan = plan
        self.profile = profile
        self.res: dict = {
            "mode": plan.mode, "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
            "max_tokens": MAX_TOKENS, "skipped": list(plan.skipped), "runs": [], "ab": [], "flood": {},
            "transfer": {"cells": [], "raw_sweep": []}, "admission": {}, "profiles": {}, "errors": [], "probe": [],
            "divergence": [],
        }
        self._colocated_tokens: dict[tuple, list[int]] = {}

    # -- one preset -------------------------------------------------------------------------------------
    def run_preset(self, pp) -> None:
        import torch

        from .colocated import Colocated
        from .stack import BenchStack
        from .workload import make_prompts

        model_dir = ensure_model(pp.preset)
        self.res.setdefault("models", {})[pp.preset] = os.path.relpath(model_dir, ROOT)
        self.res.setdefault("models_abs", {})[pp.preset] = model_dir
        log(f"{pp.preset}: starting the pdserve stack{' ×2 (checksums on / off)' if pp.ab else ''} "
            f"(broker, prefill, decode, gateway; context 4096, pools 8192/32768 tokens) ...")
        with ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(BenchStack, model_dir, True)] + ([ex.submit(BenchStack, model_dir, False)]
                                                               if pp.ab else [])
            stacks = []
            errs = []
            for f in futs:
                try:
                    stacks.append(f.result())
                except Exception as e:  # noqa: BLE001 - reported, the others still stop below
                    errs.append(e)
        if errs:
            for s in stacks:
                s.close()
            raise errs[0]
        stack_a = stacks[0]
        stack_b = stacks[1] if pp.ab else None
        try:
            log(f"{pp.preset}: stack up; loading the co-located engine (same ModelRunner, one process)")
            colo = Colocated(model_dir)
            vocab = colo.vocab_size
            lens = sorted({c.prompt_len for c in pp.cells})
            for n in lens:  # first calls allocate and warm caches in every system
                warm = make_prompts(n, 1, vocab, seed=1)
                colo.run(warm, 1, 4)
                for s in stacks:
                    s.run("warmup", pp.preset, warm, 1)
            log(f"{pp.preset}: warmed up ({torch.get_num_threads()} torch thread(s) per engine process)")
            self._matrix(pp, stack_a, colo, vocab)
            self._probe(pp, stacks, colo, vocab, lens)
            self._transformers(pp, model_dir, vocab, lens)
            if pp.ab and stack_b is not None:
                self._checksum_ab(pp, stack_a, stack_b, vocab)
            if pp.flood:
                self._flood(pp, stack_a, vocab)
            if pp.profile and self.profile:
                self._profile(pp, stack_a, colo, vocab)
            del colo
            gc.collect()
        finally:
            log(f"{pp.preset}: stopping the stack(s)")
            with ThreadPoolExecutor(2) as ex:
                list(ex.map(lambda s: s.close(), stacks))

    def _matrix(self, pp, stack, colo, vocab) -> None:
        from .stack import OtherLoad
        from .workload import MAX_TOKENS, make_prompts, summarize

        total = len(pp.cells)
        for i, cell in enumerate(pp.cells, 1):
            prompts = make_prompts(cell.prompt_len, cell.num_requests, vocab)
            tag = f"[{i}/{total}] {pp.preset} prompt {cell.prompt_len} × concurrency {cell.concurrency} " \
                  f"({cell.num_requests} requests)"
            with OtherLoad() as other:
                recs, wall = colo.run(prompts, cell.concurrency, MAX_TOKENS)
            s_colo = summarize("co-located", pp.preset, cell.prompt_len, cell.concurrency, recs, wall,
                               dict(colo.last_split, other_cores=other.cores))
            for j, r in enumerate(recs):
                self._colocated_tokens[(pp.preset, cell.prompt_len, j)] = r.token_ids
            log(f"{tag} co-located: {_short(s_colo)}")
            s_pd, pd_recs = stack.run("pdserve", pp.preset, prompts, cell.concurrency)
            s_pd.extra["agree"] = self._agreement(pp.preset, cell.prompt_len, pd_recs, "pdserve")
            log(f"{tag} pdserve:    {_short(s_pd)}  (same tokens as co-located: {s_pd.extra['agree']:.0%})")
            self.res["runs"] += [asdict(s_colo), asdict(s_pd)]

    def _probe(self, pp, stacks, colo, vocab, lens) -> None:
        """One request at a time, interleaved: co-located, pdserve, pdserve without checksums, next prompt, ...

        Gives the KV transfer time in service (prefill's metrics over these requests only) and the TTFT gap
        to co-located as paired differences, so background load hits both sides of each pair alike.
        """
        from .workload import make_prompts

        log(f"{pp.preset}: paired probe, {pp.probe_requests} requests one at a time per prompt length "
            f"(max_tokens 2): co-located, then pdserve on {len(stacks)} stack(s), interleaved")
        for n in lens:
            for i, prompt in enumerate(make_prompts(n, pp.probe_requests, vocab, seed=2)):
                recs, _ = colo.run([prompt], 1, 2)
                colo_ttft = recs[0].ttft
                for stack in stacks:
                    s, _ = stack.run("pdserve probe", pp.preset, [prompt], 1, max_tokens=2)
                    s.extra.update(colocated_ttft=colo_ttft, pair=i)
                    self.res["probe"].append(asdict(s))
            for stack in stacks:
                rs = [r for r in self.res["probe"] if r["preset"] == pp.preset and r["prompt_len"] == n
                      and r["extra"]["checksums"] == stack.checksums]
                gap = [r["ttft_p50"] - r["extra"]["colocated_ttft"] for r in rs if r["num_errors"] == 0]
                tr = sum(r["extra"]["transfer_sum"] for r in rs) / max(sum(r["extra"]["transfer_count"] for r in rs), 1)
                log(f"  prompt {n}, checksums {'on' if stack.checksums else 'off'}: TTFT − co-located "
                    f"{sorted(gap)[len(gap) // 2] * 1e3:.1f} ms median of {len(gap)} pairs; transfer "
                    f"{tr * 1e3:.2f} ms mean")

    def _agreement(self, preset: str, prompt_len: int, records, system: str = "") -> float:
        pairs = [(j, r.token_ids, self._colocated_tokens.get((preset, prompt_len, j))) for j, r in enumerate(records)]
        pairs = [(j, a, b) for j, a, b in pairs if b is not None and a]
        for j, a, b in pairs:
            if a != b:  # where greedy outputs part: the first token whose arg-max differs
                k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                self.res["divergence"].append({"system": system, "preset": preset, "prompt_len": prompt_len,
                                               "request": j, "first_different_token": k, "of": len(b)})
        return sum(a == b for _, a, b in pairs) / len(pairs) if pairs else math.nan

    def _transformers(self, pp, model_dir, vocab, lens) -> None:
        from .hf import HFBaseline
        from .stack import OtherLoad
        from .workload import MAX_TOKENS, make_prompts, summarize

        try:
            hf = HFBaseline(model_dir)
        except Exception as e:  # noqa: BLE001 - transformers is a test extra; the rest still runs
            msg = f"transformers baseline skipped: {type(e).__name__}: {e}"
            log(msg)
            self.res["errors"].append(msg)
            return
        for n in lens:
            prompts = make_prompts(n, pp.hf_requests, vocab)
            hf.run(prompts[:1], 2)  # warm-up
            with OtherLoad() as other:
                recs, wall = hf.run(prompts, MAX_TOKENS)
            s = summarize("transformers", pp.preset, n, 1, recs, wall, {"other_cores": other.cores})
            s.extra["agree"] = self._agreement(pp.preset, n, recs, "transformers")
            log(f"{pp.preset} prompt {n} transformers (serial, {pp.hf_requests} requests): {_short(s)}  "
                f"(same tokens as co-located: {s.extra['agree']:.0%})")
            self.res["runs"].append(asdict(s))
        del hf
        gc.collect()

    def _checksum_ab(self, pp, stack_a, stack_b, vocab) -> None:
        from .workload import make_prompts

        for k, cell in enumerate(pp.ab):
            prompts = make_prompts(cell.prompt_len, cell.num_requests, vocab)
            log(f"{pp.preset}: checksum A/B, prompt {cell.prompt_len} × concurrency {cell.concurrency} "
                f"({cell.num_requests} requests), {self.plan.repeats} interleaved pairs")
            for i in range(self.plan.repeats):
                for stack, label in ((stack_a, "on"), (stack_b, "off")):
                    s, _ = stack.run(f"pdserve checksums {label}", pp.preset, prompts, cell.concurrency)
                    s.extra.update(pair=i, ab_cell=k)
                    self.res["ab"].append(asdict(s))
                    log(f"  pair {i + 1}/{self.plan.repeats} checksums {label:>3}: {_short(s)}")

    def _flood(self, pp, stack, vocab) -> None:
        from .plan import CONTEXT
        from .stack import cpu_seconds
        from .workload import make_prompts

        over = CONTEXT + 1
        cmd = [sys.executable, "-u", "-m", "bench.flood", stack.gateway, "--prompt-len", str(over)]
        gw_pid = stack.pids()["gateway"]
        log(f"{pp.preset}: over-long flood ({over}-token prompts): capacity, 16 closed-loop clients, "
            f"{self.plan.flood_seconds:.1f} s")
        spy = None
        if self.profile:
            from . import profile

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
            from . import profile

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
            f"under a 1,000/s over-long flood, {self.plan.repeats} interleaved pairs")
        for i in range(self.plan.repeats):
            alone, _ = stack.run("pdserve", pp.preset, prompts, cell.concurrency)
            proc = subprocess.Popen(cmd + ["--rate", "1000", "--seconds", "120", "--concurrency", "64",
                                           "--stop-on-stdin"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, cwd=ROOT)
            try:
                first = proc.stdout.readline()
                if '"ready"' not in first:
                    raise RuntimeError(f"flood did not start: {first} {proc.stderr.read()[-2000:]}")
                time.sleep(0.2)  # the flood reaches its rate before the measured traffic starts
                loaded, _ = stack.run("pdserve+flood", pp.preset, prompts, cell.concurrency)
                proc.stdin.write("stop\n")
                proc.stdin.flush()
                fl = json.loads(proc.stdout.readline())
                proc.wait(60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(5)
            pairs.append({"alone": asdict(alone), "flood": asdict(loaded), "flood_stats": fl})
            log(f"  pair {i + 1}: alone {alone.out_tok_s:.0f} tok/s, TTFT p50 {alone.ttft_p50 * 1e3:.1f} ms | "
                f"flooded {loaded.out_tok_s:.0f} tok/s, TTFT p50 {loaded.ttft_p50 * 1e3:.1f} ms, "
                f"{fl['rejected_per_s']:.0f} rejections/s {fl['codes']}")
        self.res["flood"] = {"capacity": cap, "pairs": pairs, "prompt_len": over, "cell": asdict(cell)}

    def _profile(self, pp, stack, colo, vocab) -> None:
        from . import profile
        from .workload import MAX_TOKENS, make_prompts

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

    # -- after the presets ----------------------------------------------------------------------------------
    def transfer(self) -> None:
        # per (preset, prompt, checksums): the probe runs (else every run at the lowest concurrency seen), pooled
        groups: dict[tuple, list[dict]] = {}
        for r in self.res["probe"] or self.res["runs"] + self.res["ab"]:
            if r["system"].startswith("pdserve") and r["extra"].get("transfer_count"):
                groups.setdefault((r["preset"], r["prompt_len"], r["extra"]["checksums"]), []).append(r)
        if not groups:
            return
        log("raw Mooncake: the same bytes, process to process, no forward pass, no checksum; and prefill's "
            "write step alone")
        with _quiet_stderr():  # Mooncake's glog writes to fd 2 directly; our progress goes to stdout
            self._transfer(groups)

    def _transfer(self, groups) -> None:
        from .mooncake_raw import TAG_NBYTES, RawMooncake
        from .writepath import measure as write_path

        raw = RawMooncake(64 << 20)
        try:
            out = []
            for (preset, n, checksums), rs in sorted(groups.items()):
                c = min(r["concurrency"] for r in rs)
                rs = [r for r in rs if r["concurrency"] == c]
                count = sum(r["extra"]["transfer_count"] for r in rs)
                per_req = sum(r["extra"]["transfer_bytes"] for r in rs) / count
                pages = -(-n // 16)
                # small transfers are quick and noisy: more repeats for them
                reps = max(self.plan.raw_repeats, min(50, int(32e6 / per_req)))
                ts = sorted(raw.measure(int(per_req - pages * TAG_NBYTES), pages * TAG_NBYTES, reps))
                # paced like the probe: one transfer after each idle gap (capped: the wake-up cost stops growing)
                gap = min(0.1, sum(r["ttft_mean"] for r in rs) / len(rs))
                paced = raw.measure(int(per_req - pages * TAG_NBYTES), pages * TAG_NBYTES, 10, gap_s=gap)
                wp = write_path(self.res["models_abs"][preset], n, raw, reps, checksums)
                buckets: dict[str, float] = {}
                for r in rs:
                    for le, v in r["extra"].get("transfer_buckets", {}).items():
                        buckets[le] = buckets.get(le, 0.0) + v
                row = {"preset": preset, "prompt_len": n, "checksums": checksums, "bytes": per_req, "pages": pages,
                       "concurrency": c, "num_transfers": count, "p50_s": hist_quantile(buckets, 0.5),
                       "pdserve_s": sum(r["extra"]["transfer_sum"] for r in rs) / count,
                       "checksum_s": sum(r["extra"]["prefill_checksum_sum"] for r in rs) / count,
                       "raw_s": ts[len(ts) // 2], "raw_all": ts, "write_path": wp,
                       "raw_paced_s": sum(paced) / len(paced), "raw_paced_gap_s": gap}
                out.append(row)
                log(f"  {preset} prompt {n} ({per_req / 1e6:.2f} MB, checksums {'on' if checksums else 'off'}): "
                    f"in service {per_req / row['pdserve_s'] / 1e9:.2f} GB/s, write step alone "
                    f"{per_req / wp['median_s'] / 1e9:.2f} GB/s, raw {per_req / row['raw_s'] / 1e9:.2f} GB/s "
                    f"back to back, {per_req / row['raw_paced_s'] / 1e9:.2f} GB/s paced")
            self.res["transfer"]["cells"] = out
            sweep = []
            for nb in (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20):
                ts = sorted(raw.measure(nb, 0, max(self.plan.raw_repeats, min(50, int(32e6 / nb)))))
                sweep.append({"bytes": nb, "median_s": ts[len(ts) // 2]})
            self.res["transfer"]["raw_sweep"] = sweep
            log("  sweep: " + ", ".join(f"{s['bytes'] >> 10} KiB {s['bytes'] / s['median_s'] / 1e9:.2f} GB/s"
                                        for s in sweep))
        finally:
            raw.close()

    def admission(self) -> None:
        out = subprocess.run([sys.executable, "-m", "bench.admission", ensure_model("tiny"),
                              str(self.plan.admission_iters)], capture_output=True, text=True, cwd=ROOT, timeout=300)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        res = json.loads(out.stdout.strip().splitlines()[-1])
        self.res["admission"] = res
        log(f"gateway admission decision (GatewayServicer.admit, in a gateway-sized process): "
            f"p50 {res['all']['p50'] * 1e6:.0f} µs, p99 {res['all']['p99'] * 1e6:.0f} µs "
            f"(thread CPU time p99 {res['all']['cpu_p99'] * 1e6:.0f} µs)")


def hist_quantile(buckets: dict[str, float], q: float) -> float:
    """Prometheus-style quantile from cumulative bucket counts {le: count}, linear within a bucket."""
    edges = sorted((float(le), c) for le, c in buckets.items())
    if not edges or edges[-1][1] <= 0:
        return math.nan
    rank = q * edges[-1][1]
    lo_edge, lo_count = 0.0, 0.0
    for edge, count in edges:
        if count >= rank:
            if math.isinf(edge):
                return lo_edge
            return lo_edge + (edge - lo_edge) * (rank - lo_count) / max(count - lo_count, 1e-12)
        lo_edge, lo_count = edge, count
    return lo_edge


class _quiet_stderr:
    """Points fd 2 at /dev/null for a while (C++ libraries log there directly)."""

    def __enter__(self):
        sys.stderr.flush()
        self._saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc):
        os.dup2(self._saved, 2)
        os.close(self._saved)
        return False


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny preset only, a few cells: under 3 minutes")
    p.add_argument("--no-profile", action="store_true", help="skip the py-spy profiles")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: rebuild the table and plots from bench/results/bench-<mode>.json")
    return p.parse_args(argv)


def _write_plots(res: dict) -> None:
    try:
        from .plots import write_plots
    except ImportError as e:
        print(f"\nplots skipped: matplotlib is not installed ({e}); `.venv/bin/pip install matplotlib` "
              f"or `pip install -e '.[bench]'` adds them. The tables above are complete.", flush=True)
    else:
        for p in write_plots(res, RESULTS):
            log(f"wrote {os.path.relpath(p, ROOT)}")


def report_only(mode: str) -> int:
    from . import profile
    from .report import write_report

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


def main(args=None) -> int:
    if args is None:
        args = parse()
    if getattr(args, "report_only", False):
        return report_only("quick" if args.quick else "full")
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's glog: errors only on our stderr
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    os.chdir(ROOT)
    from services.engine.runner import set_threads

    from . import plan as plans
    from .report import write_report

    plan = plans.quick() if getattr(args, "quick", False) else plans.full()
    # the same intra-op threads as each pdserve engine process (half the cores): engine against engine
    set_threads()
    log(f"pdserve bench ({plan.mode}): {', '.join(p.preset for p in plan.presets)}; "
        f"{sum(len(p.cells) for p in plan.presets)} cells × (co-located, pdserve) + transformers + raw Mooncake")
    for s in plan.skipped:
        log(f"skipping {s}")
    bench = Bench(plan, profile=not getattr(args, "no_profile", False))
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
    for step in (bench.transfer, bench.admission):
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
