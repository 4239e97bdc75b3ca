"""A pdserve stack for the benchmark (real services on port 0) and what each run cost it.

Per run: the client's view (Records), plus deltas of every service's /metrics (guard seconds,
transfer bytes and seconds, server-side RPC seconds, gateway-side TTFT) and of each process's CPU
seconds, so a slow number can be traced to the process and the step that spent the time.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time

from pdserve import launcher

from .pdclient import delta, run_load, scrape
from .workload import MAX_TOKENS, Record, Summary, summarize

GUARD_KINDS = ("grant_rpc", "begin_write_rpc", "begin_write_wait", "end_write_rpc", "validate_rpc", "release_rpc", "checksum",
               "prompt_verify", "step_tag_check", "checksum_sweep")
# guards decode runs once per step for the whole batch: their time is charged to output throughput
STEP_KINDS = ("step_tag_check", "checksum_sweep")
# guards every request waits for between admission and its first token (release runs after the last token,
# step_tag_check and checksum_sweep once per decode step for the whole batch); BeginWrite runs during the forward pass,
# so what it adds is begin_write_wait, the time prefill still waits for it once the pass is done
TTFT_KINDS = ("grant_rpc", "begin_write_wait", "checksum", "end_write_rpc", "prompt_verify", "validate_rpc")
SERVICES = ("gateway", "broker", "prefill", "decode")
_TICK = os.sysconf("SC_CLK_TCK")


def machine_cpu_seconds() -> float:
    """CPU seconds every core of the machine has spent busy since boot (/proc/stat)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v[:8]) - v[3] - v[4]) / _TICK  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        return 0.0


class OtherLoad:
    """Cores kept busy by everything but this process while the block runs: `with OtherLoad() as o: ...; o.cores`."""

    def __enter__(self):
        self._m, self._p, self._t = machine_cpu_seconds(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        dt = time.perf_counter() - self._t
        mine = time.process_time() - self._p
        self.cores = max(0.0, machine_cpu_seconds() - self._m - mine) / dt if dt else float("nan")
        return False


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far (from /proc; 0 where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return 0.0


class BenchStack:
    def __init__(self, model_dir: str, checksums: bool = True, device: str = "cpu"):
        self.checksums = checksums
        self.log_dir = tempfile.mkdtemp(prefix="pdserve-bench-")
        flag = ["--device", device] + ([] if checksums else ["--no-transfer-checksum", "--allow-unsafe",
                                                              "no-transfer-checksum"])
        self.procs = launcher.start_stack(model_dir, log_dir=self.log_dir, env={"GLOG_minloglevel": "2"},
                                          extra={"prefill": flag, "decode": flag})
        self.gateway = self.procs["gateway"][0].target

    def pids(self) -> dict[str, int]:
        return {name: ps[0].popen.pid for name, ps in self.procs.items()}

    def cpu_sample(self) -> dict[str, float]:
        """CPU seconds so far of every stack process, this (client) process and the whole machine, and the clock."""
        cpu = {s: cpu_seconds(pid) for s, pid in self.pids().items()}
        cpu["client"] = time.process_time()
        cpu["machine"] = machine_cpu_seconds()
        cpu["wall"] = time.perf_counter()
        return cpu

    @staticmethod
    def other_cores(c0: dict[str, float], c1: dict[str, float]) -> float:
        """Cores kept busy between two cpu_samples by everything but the stack and the client: the noise floor."""
        cpu = {k: c1[k] - c0[k] for k in c1}
        machine, elapsed = cpu.pop("machine"), cpu.pop("wall")
        return max(0.0, machine - sum(cpu.values())) / elapsed if elapsed else float("nan")

    def _sample(self) -> tuple[dict[str, dict], dict[str, float]]:
        return {s: scrape(self.procs[s][0].metrics_port) for s in SERVICES}, self.cpu_sample()

    def run(self, system: str, preset: str, prompts: list[list[int]], concurrency: int,
            max_tokens: int = MAX_TOKENS) -> tuple[Summary, list[Record]]:
        m0, c0 = self._sample()
        records, wall = run_load(self.gateway, prompts, concurrency, max_tokens)
        m1, c1 = self._sample()
        d = {s: delta(m1[s], m0[s]) for s in m1}
        guard = {k: sum(d[s].get(("pdserve_guard_seconds_sum", f'kind="{k}"'), 0.0) for s in ("prefill", "decode"))
                 for k in GUARD_KINDS}
        rpc = {}
        for s in SERVICES:
            for (name, labels), v in d[s].items():
                if name == "pdserve_rpc_seconds_sum" and v:
                    method = labels.split('"')[1]
                    rpc[f"{s}.{method}"] = (v, d[s].get(("pdserve_rpc_seconds_count", labels), 0.0))
        for s, phase in (("prefill", "prefill"), ("decode", "decode")):
            labels = f'phase="{phase}"'
            rpc[f"{s}.forward"] = (d[s].get(("pdserve_forward_seconds_sum", labels), 0.0),
                                   d[s].get(("pdserve_forward_seconds_count", labels), 0.0))
        g = d["gateway"]
        rpc["gateway.ttft"] = (g.get(("pdserve_time_to_first_token_seconds_sum", ""), 0.0),
                               g.get(("pdserve_time_to_first_token_seconds_count", ""), 0.0))
        p = d["prefill"]
        cpu = {k: c1[k] - c0[k] for k in c1 if k not in ("machine", "wall")}
        extra = {"guard": guard, "rpc": rpc, "cpu": cpu,
                 # cores kept busy by everything else on the machine (other users' work): the noise floor
                 "other_cores": self.other_cores(c0, c1),
                 "transfer_buckets": {labels.split('"')[1]: v for (name, labels), v in p.items()
                                      if name == "pdserve_kv_transfer_seconds_bucket"},
                 "transfer_bytes": p.get(("pdserve_kv_transfer_bytes_total", ""), 0.0),
                 "transfer_sum": p.get(("pdserve_kv_transfer_seconds_sum", ""), 0.0),
                 "transfer_count": p.get(("pdserve_kv_transfer_seconds_count", ""), 0.0),
                 "prefill_checksum_sum": p.get(("pdserve_guard_seconds_sum", 'kind="checksum"'), 0.0),
                 "checksums": self.checksums}
        errors = [r.error for r in records if r.error]
        if errors:
            extra["first_error"] = errors[0]
            self.settle()
        return summarize(system, preset, len(prompts[0]), concurrency, records, wall, extra), records

    # -- the guard-cost A/B: requests sent without a scrape around each, the guards' exact time per series ------
    def send(self, prompts: list[list[int]], concurrency: int, max_tokens: int = MAX_TOKENS
             ) -> tuple[list[Record], float]:
        """The client's view only: no /metrics read around it, so a pair's two requests follow each other closely."""
        return run_load(self.gateway, prompts, concurrency, max_tokens)

    def guard_sample(self) -> dict:
        """Counters for a series of A/B requests, read before and after it (series_cost takes the difference):
        prefill's and decode's guard seconds and calls by kind, decode's steps and their forward seconds, the
        gateway's first tokens, every stack process's CPU seconds."""
        d, p = scrape(self.procs["decode"][0].metrics_port), scrape(self.procs["prefill"][0].metrics_port)
        g = scrape(self.procs["gateway"][0].metrics_port)
        out = {f"guard_s.{k}": sum(m.get(("pdserve_guard_seconds_sum", f'kind="{k}"'), 0.0) for m in (p, d))
               for k in GUARD_KINDS}
        out |= {f"guard_n.{k}": sum(m.get(("pdserve_guard_seconds_count", f'kind="{k}"'), 0.0) for m in (p, d))
                for k in GUARD_KINDS}
        for k in STEP_KINDS:  # the per-step guards' distribution: a mean alone hides a rare preempted call
            out |= {f"guard_b.{k}.{labels.rpartition('le=')[2].strip(chr(34))}": v for (name, labels), v in d.items()
                    if name == "pdserve_guard_seconds_bucket" and f'kind="{k}"' in labels}
        out["steps"] = d.get(("pdserve_forward_seconds_count", 'phase="decode"'), 0.0)
        out["step_forward_s"] = d.get(("pdserve_forward_seconds_sum", 'phase="decode"'), 0.0)
        out["first_tokens"] = g.get(("pdserve_time_to_first_token_seconds_count", ""), 0.0)
        out |= {f"cpu_s.{k}": v for k, v in self.cpu_sample().items() if k not in ("client", "machine")}
        return out

    @staticmethod
    def series_cost(before: dict, after: dict) -> dict:
        """What a series cost between two guard_samples: guard seconds and calls by kind, steps, first tokens,
        CPU seconds by process (wall: the series' elapsed time)."""
        d = {k: after[k] - before[k] for k in after}
        return {"guard": {k: d[f"guard_s.{k}"] for k in GUARD_KINDS},
                "guard_calls": {k: d[f"guard_n.{k}"] for k in GUARD_KINDS},
                "step_buckets": {k: {b.split(".", 2)[2]: v for b, v in d.items() if b.startswith(f"guard_b.{k}.")}
                                 for k in STEP_KINDS},
                "steps": d["steps"], "step_forward_s": d["step_forward_s"], "first_tokens": d["first_tokens"],
                "cpu": {k[6:]: v for k, v in d.items() if k.startswith("cpu_s.") and k != "cpu_s.wall"},
                "wall_s": d["cpu_s.wall"]}

    def settle(self, quiet_s: float = 2.0, timeout_s: float = 180.0) -> None:
        """Waits until prefill has no backlog: a request the client gave up on still runs its prefill and
        transfer (by design), and that work must not land in the next measurement."""
        port = self.procs["prefill"][0].metrics_port
        key = ("pdserve_rpc_seconds_count", 'method="Prefill"')
        last, since, deadline = None, time.monotonic(), time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            now = scrape(port).get(key, 0.0)
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
            time.sleep(0.5)

    def close(self) -> None:
        launcher.stop_stack(self.procs)
        shutil.rmtree(self.log_dir, ignore_errors=True)  # a start-up failure already carries the log tail
