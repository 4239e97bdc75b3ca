"""Bench step: TTFT and ITL against offered load, open loop (Poisson arrivals), for pdserve and co-located.

Per sweep: co-located's unloaded TTFT fixes the SLO for both systems; each system's saturation is the req/s
of a closed loop at high concurrency; then every level sends the same seeded schedule (scaled to
multiple × that system's saturation) and the same prompts, co-located first, then pdserve, back to back.
"""
from __future__ import annotations

from dataclasses import asdict

from ..harness.common import log


class SweepStep:
    """Mixed into Bench (uses its res)."""

    def _sweep(self, pp, stack, colo, vocab) -> None:
        from ..harness.openloop import SLO_FACTOR, Slo
        from ..harness.stack import OtherLoad
        from ..harness.workload import MAX_TOKENS, make_prompts, summarize

        for sw in pp.sweep:
            n = sw.prompt_len
            recs, _ = colo.run(make_prompts(n, sw.unloaded_requests, vocab, seed=4), 1, MAX_TOKENS)
            unloaded = summarize("co-located", pp.preset, n, 1, recs, 1.0).ttft_p50
            slo = Slo.from_unloaded(unloaded)
            sat_prompts = make_prompts(n, sw.saturation.num_requests, vocab, seed=5)
            with OtherLoad() as other:
                recs, wall = colo.run(sat_prompts, sw.saturation.concurrency, MAX_TOKENS)
            sat = {"co-located": summarize("co-located", pp.preset, n, sw.saturation.concurrency, recs, wall,
                                           {"other_cores": other.cores})}
            sat["pdserve"], _ = stack.run("pdserve", pp.preset, sat_prompts, sw.saturation.concurrency)
            for system, s in sat.items():  # refusals at saturation are the system's answer; no answer at all is not
                if not s.req_s > 0:
                    raise RuntimeError(f"sweep prompt {n}: {system}'s saturation run finished no request "
                                       f"({s.num_errors} errors of {s.num_requests}: {s.extra.get('first_error')})")
            log(f"{pp.preset}: load sweep at prompt {n}: SLO TTFT {slo.ttft_s * 1e3:.0f} ms (co-located unloaded "
                f"p50 {unloaded * 1e3:.1f} ms × {SLO_FACTOR:g}), clients give up at {slo.deadline_s * 1e3:.0f} ms; "
                f"saturation (closed loop, concurrency {sw.saturation.concurrency}): co-located "
                f"{sat['co-located'].req_s:.2f}, "
                f"pdserve {sat['pdserve'].req_s:.2f} req/s")
            entry = {"preset": pp.preset, "prompt_len": n, "unloaded_ttft_s": unloaded, "slo_s": slo.ttft_s,
                     "deadline_s": slo.deadline_s, "saturation": {k: asdict(v) for k, v in sat.items()},
                     "window_s": sw.seconds, "levels": []}
            self.res["sweep"].append(entry)
            for m in sw.multiples:
                for system in ("co-located", "pdserve"):
                    entry["levels"].append(self._level(pp, sw, stack, colo, vocab, system, m,
                                                       m * sat[system].req_s, slo))

    def _level(self, pp, sw, stack, colo, vocab, system, multiple, rate, slo) -> dict:
        from ..harness.openloop import GAVE_UP, goodput, poisson_offsets, prefill_counts
        from ..harness.pdclient import run_open, scrape
        from ..harness.stack import OtherLoad
        from ..harness.workload import MAX_TOKENS, make_prompts, percentile, summarize

        offsets = poisson_offsets(rate, sw.seconds, sw.min_requests, sw.max_requests)
        prompts = make_prompts(sw.prompt_len, len(offsets), vocab, seed=3)
        level: dict = {"system": system, "multiple": multiple, "rate": rate, "window_s": offsets[-1]}
        if system == "co-located":
            with OtherLoad() as other:
                recs, wall = colo.run_open(prompts, offsets, MAX_TOKENS, slo.deadline_s)
            level.update(prefills=colo.last_split["prefills"], other_cores=other.cores)
        else:
            port = stack.procs["prefill"][0].metrics_port
            before, c0 = scrape(port), stack.cpu_sample()
            recs, wall, lags = run_open(stack.gateway, prompts, offsets, MAX_TOKENS, slo.deadline_s)
            level["other_cores"] = stack.other_cores(c0, stack.cpu_sample())
            stack.settle()  # the passes prefill still runs for callers that left belong to this level
            level["prefill"] = prefill_counts(before, scrape(port))
            level["send_lag_p99_s"] = percentile(lags, 99)
        s = summarize(system, pp.preset, sw.prompt_len, 0, recs, wall)
        level["summary"] = asdict(s)
        level["goodput"] = g = goodput(recs, slo, wall, MAX_TOKENS)
        level["first_tokens"] = sum(bool(r.token_ids) for r in recs)
        level["error_codes"] = codes = {}
        for r in recs:
            if r.error and r.error != GAVE_UP:
                code = r.error.split()[0]
                codes[code] = codes.get(code, 0) + 1
                level.setdefault("first_error", r.error)
        pf = level.get("prefill")
        gone = "" if pf is None else (f"; prefill: {pf['passes']:.0f} passes" + (
            f", {pf['forward_for_gone']:.0f} for gone callers, dropped {pf['dropped_deadline']:.0f} (deadline) + "
            f"{pf['dropped_cancelled']:.0f} (cancelled)" if pf["counted"] else ", its queue counters not live"))
        log(f"  {multiple:g}× {system:<10} {rate:6.2f} req/s × {len(offsets)}: TTFT p50 {s.ttft_p50 * 1e3:.0f} ms "
            f"p99 {s.ttft_p99 * 1e3:.0f} ms, good {g['good']}/{g['offered']} ({g['goodput_req_s']:.2f}/s), gave up "
            f"{g['gave_up']}, errors {codes or 0}{gone}")
        return level
