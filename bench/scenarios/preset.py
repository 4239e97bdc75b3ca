"""One preset measured: the stack and co-located engine up, the matrix, the paired probe, transformers and the
checksum A/B (then the flood and profiles, from the mixins)."""
from __future__ import annotations

import datetime
import gc
import math
import os
import platform
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from ..harness.common import ROOT, _short, ensure_model, git_commit, log
from .decode_step import DecodeStepStep
from .gateway import GatewaySteps
from .guidellm import GuidellmStep
from .profile import ProfileStep
from .sweep import SweepStep
from .transfer import TransferSteps


def _device_name(device: str) -> str:
    import torch

    return f"cuda ({torch.cuda.get_device_name()})" if device == "cuda" else "cpu"


def _commit() -> str:
    """The commit measured, or why there is none (a tree without git still runs the bench; its table says so)."""
    try:
        return git_commit()
    except (OSError, subprocess.CalledProcessError, RuntimeError) as e:
        return f"unknown ({type(e).__name__}: {e})"


class Bench(DecodeStepStep, GatewaySteps, GuidellmStep, ProfileStep, SweepStep, TransferSteps):
    """One bench run: every preset's measurements, then the steps after them; results collect in res."""

    def __init__(self, plan, profile: bool, device: str = "cpu"):
        from ..harness.workload import MAX_TOKENS

        self.plan = plan
        self.profile = profile
        self.device = device
        self.res: dict = {
            "mode": plan.mode, "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "commit": _commit(),
            "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                     "device": _device_name(device)},
            "max_tokens": MAX_TOKENS, "skipped": list(plan.skipped), "runs": [], "ab": [], "flood": {},
            "transfer": {"cells": [], "raw_sweep": []}, "admission": {}, "profiles": {}, "errors": [], "probe": [],
            "divergence": [], "sweep": [], "decode_step": {},
        }
        self._colocated_tokens: dict[tuple, list[int]] = {}

    # -- one preset -------------------------------------------------------------------------------------
    def run_preset(self, pp) -> None:
        import torch

        from ..peers.colocated import Colocated
        from ..harness.stack import BenchStack
        from ..harness.workload import make_prompts

        model_dir = ensure_model(pp.preset)
        self.res.setdefault("models", {})[pp.preset] = os.path.relpath(model_dir, ROOT)
        self.res.setdefault("models_abs", {})[pp.preset] = model_dir
        log(f"{pp.preset}: starting the pdserve stack{' ×2 (checksums on / off)' if pp.ab else ''} "
            f"(broker, prefill, decode, gateway; context 4096, pools 8192/32768 tokens) ...")
        with ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(BenchStack, model_dir, checksums, self.device)
                    for checksums in ((True, False) if pp.ab else (True,))]
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
            colo = Colocated(model_dir, device=self.device)
            vocab = colo.vocab_size
            lens = sorted({c.prompt_len for c in pp.cells})
            for n in lens:  # first calls allocate and warm caches in every system
                warm = make_prompts(n, 1, vocab, seed=1)
                colo.run(warm, 1, 4)
                for s in stacks:
                    s.run("warmup", pp.preset, warm, 1)
            log(f"{pp.preset}: warmed up ({torch.get_num_threads()} torch thread(s) per engine process)")
            if pp.ab and stack_b is not None:
                # first, while both stacks have served the warm-up alone: a stack that had served more (the
                # matrix) would differ from the other by its history, which the swap between halves only halves
                self._checksum_ab(pp, stacks, model_dir, vocab)  # restarts both stacks: the list holds the new ones
                stack_a = next(s for s in stacks if s.checksums)
            self._matrix(pp, stack_a, colo, vocab)
            self._probe(pp, stacks, colo, vocab, lens)
            self._transformers(pp, model_dir, vocab, lens)
            if pp.guidellm:
                self._guidellm(pp, stack_a, model_dir, vocab)
            if pp.flood:
                self._flood(pp, stack_a, vocab)
            if pp.sweep:
                try:
                    self._sweep(pp, stack_a, colo, vocab)
                except Exception as e:  # noqa: BLE001 - the profiles after it still run; the report says what failed
                    msg = f"{pp.preset} load sweep: {type(e).__name__}: {e}"
                    log(f"FAILED {msg}")
                    self.res["errors"].append(msg[:2000])
            if pp.profile and self.profile:
                self._profile(pp, stack_a, colo, vocab)
            del colo
            gc.collect()
        finally:
            log(f"{pp.preset}: stopping the stack(s)")
            with ThreadPoolExecutor(2) as ex:
                list(ex.map(lambda s: s.close(), stacks))

    def _matrix(self, pp, stack, colo, vocab) -> None:
        from ..harness.stack import OtherLoad
        from ..harness.workload import MAX_TOKENS, make_prompts, summarize

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
        """One request at a time, interleaved: co-located, pdserve, pdserve without checksums (those two in
        alternating order), next prompt, ...

        Gives the KV transfer time in service (prefill's metrics over these requests only) and the TTFT gap
        to co-located as paired differences, so background load hits both sides of each pair alike.
        """
        from ..harness.workload import make_prompts

        log(f"{pp.preset}: paired probe, {pp.probe_requests} requests one at a time per prompt length "
            f"(max_tokens 2): co-located, then pdserve on {len(stacks)} stack(s), interleaved")
        for n in lens:
            for i, prompt in enumerate(make_prompts(n, pp.probe_requests, vocab, seed=2)):
                recs, _ = colo.run([prompt], 1, 2)
                colo_ttft = recs[0].ttft
                # the stack that goes first after co-located finds the machine idlest: alternate who that is
                for stack in stacks if i % 2 == 0 else stacks[::-1]:
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
        from ..peers.hf import HFBaseline
        from ..harness.stack import OtherLoad
        from ..harness.workload import MAX_TOKENS, make_prompts, summarize

        try:
            hf = HFBaseline(model_dir, self.device)
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

    def _checksum_ab(self, pp, stacks: list, model_dir: str, vocab) -> None:
        """Guard cost, paired: checksums on against off, the same prompts to both stacks back to back, alternating
        which stack goes first, pairs until each half's share of the cell's time is up (AB_SECONDS, at least
        AB_MIN_PAIRS in all).

        Two identical stacks differ by themselves (start order, ports, where the scheduler puts their processes:
        an A/A run put one 23 % above the other in TTFT), so the pairs run in two halves with the flags swapped
        between the stack slots: after the first half both stacks are restarted, each with the other flag, in
        their slots. The report takes the on/off difference as the mean of the two halves' and the slot's own
        term as half their difference. stacks is updated in place with the restarted stacks.

        At concurrency 1 a pair is one request (its TTFT and tok/s); above it, one closed-loop run of
        the cell's requests (its output tok/s). Around each stack's series, the guards' own in-process seconds
        (pdserve_guard_seconds) give the exact cost per request and per step, the tag check included (it runs on
        both stacks: nothing turns it off)."""
        budget = AB_SECONDS.get(self.plan.mode, AB_SECONDS["quick"]) / 2
        min_pairs = -(-AB_MIN_PAIRS // 2)
        next_pair = [0] * len(pp.ab)
        for half in (0, 1):
            if half:
                self._restart_swapped(pp, stacks, model_dir, vocab)
            for k, cell in enumerate(pp.ab):
                next_pair[k] = self._ab_half(pp, stacks, k, cell, half, next_pair[k], budget, min_pairs, vocab)

    def _ab_half(self, pp, stacks, k, cell, half, first_pair, budget, min_pairs, vocab) -> int:
        """One half of one A/B cell; returns the next pair number."""
        from ..harness.workload import MAX_TOKENS, make_prompts, summarize

        roles = ", ".join(f"slot {'AB'[j]} {'on' if st.checksums else 'off'}" for j, st in enumerate(stacks))
        log(f"{pp.preset}: guard cost A/B (checksums on / off), prompt {cell.prompt_len} × concurrency "
            f"{cell.concurrency}, half {half + 1} of 2 ({roles}): paired "
            f"{'requests' if cell.concurrency == 1 else 'runs'} for {budget:.0f} s")
        before = [st.guard_sample() for st in stacks]
        done: list[dict] = []
        deadline = time.monotonic() + budget
        i = 0
        while i < min_pairs or (time.monotonic() < deadline and i < AB_MAX_PAIRS):
            pair = first_pair + i
            # distinct prompts per pair: neither stack's prefix cache may answer a prompt seen before
            prompts = make_prompts(cell.prompt_len, cell.num_requests if cell.concurrency > 1 else 1, vocab,
                                   seed=7919 + 1000 * k + pair)
            order = (0, 1) if pair % 2 == 0 else (1, 0)
            for j, slot in enumerate(order):
                stack = stacks[slot]
                label = "on" if stack.checksums else "off"
                if cell.concurrency == 1:
                    recs, wall = stack.send(prompts, 1, MAX_TOKENS)
                    s = summarize(f"pdserve checksums {label}", pp.preset, cell.prompt_len, 1, recs, wall)
                else:
                    s, _ = stack.run(f"pdserve checksums {label}", pp.preset, prompts, cell.concurrency)
                s.extra.update(pair=pair, ab_cell=k, checksums=stack.checksums, first=j == 0, half=half, slot=slot)
                done.append(asdict(s))
            i += 1
        for st, b in zip(stacks, before):
            series = st.series_cost(b, st.guard_sample())
            last = next(r for r in reversed(done) if r["extra"]["checksums"] == st.checksums)
            last["extra"]["series"] = series
        self.res["ab"] += done
        errors = sum(r["num_errors"] for r in done)
        log(f"  {i} pairs{f', {errors} failed requests' if errors else ''}")
        return first_pair + i

    def _restart_swapped(self, pp, stacks: list, model_dir: str, vocab) -> None:
        """Both stacks stopped and started again in their slots, each with the other flag, then warmed up."""
        from ..harness.workload import make_prompts

        t0 = time.monotonic()
        flags = [not st.checksums for st in stacks]
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda st: st.close(), stacks))
        stacks.clear()
        with ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(self._start_stack, model_dir, f) for f in flags]
            errs = []
            for f in futs:  # slot order kept; the ones that started are closed by run_preset
                try:
                    stacks.append(f.result())
                except Exception as e:  # noqa: BLE001 - raised below, once every start has ended
                    errs.append(e)
        if errs:
            raise errs[0]
        # every length the later steps send too: the on stack serves them after the A/B
        for n in sorted({c.prompt_len for c in (*getattr(pp, "cells", ()), *pp.ab)}):
            warm = make_prompts(n, 1, vocab, seed=1)
            for st in stacks:
                st.run("warmup", pp.preset, warm, 1)
        log(f"{pp.preset}: stacks restarted with the flags swapped between the slots and warmed up in "
            f"{time.monotonic() - t0:.0f} s")

    def _start_stack(self, model_dir: str, checksums: bool):
        from ..harness.stack import BenchStack

        return BenchStack(model_dir, checksums, self.device)


# time per A/B cell: pairs are taken until it is up (at least AB_MIN_PAIRS, at most AB_MAX_PAIRS)
AB_SECONDS = {"quick": 40.0, "full": 60.0}
AB_MIN_PAIRS, AB_MAX_PAIRS = 10, 1000
