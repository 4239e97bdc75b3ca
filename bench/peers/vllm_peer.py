"""`vllm serve` from bench/.vllm-venv as a child process: started, waited for, measured (start-up seconds, resident
memory of its process tree, what it says about its threads and KV cache) and stopped with its whole tree."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request

from . import vllm_venv

# lines of vLLM's start-up log worth keeping in the results: its thread binding and the KV cache it sized
_KEEP = re.compile(r"core ids=|reserved_cpus=|CPU KV cache size|Reducing Torch threads|init engine .* took|"
                   r"Maximum concurrency|OMP_NUM_THREADS|VLLM_CPU_OMP_THREADS_BIND")
_KV_TOKENS = re.compile(r"CPU KV cache size: ([\d,]+) tokens")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_stats(pgids) -> list[tuple[int, list[str]]]:
    """(pid, the fields of /proc/<pid>/stat after the command name) of every live process in these process groups
    (field 2 of that list is the process group)."""
    want, out = set(pgids), []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            if int(fields[2]) in want:
                out.append((int(pid), fields))
        except (OSError, ValueError, IndexError):
            continue
    return out


def group_rss_bytes(pgid: int) -> int:
    """Resident bytes of every process in one process group (a server and the workers it forked)."""
    total = 0
    for pid, _ in group_stats([pgid]):
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        except (OSError, ValueError, IndexError, StopIteration):
            continue
    return total


class VllmPeer:
    """One `vllm serve` of model_dir: `with VllmPeer(...) as v: v.url ...`."""

    def __init__(self, model_dir: str, name: str, max_model_len: int, kv_cache_bytes: int, dtype: str,
                 log_path: str, timeout_s: float = 900.0, prefix_caching: bool = False):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.lines: list[str] = []
        exe = os.path.join(vllm_venv.VENV, "bin", "vllm")  # the CLI itself: what the name shim is for
        self.args = [exe, "serve", model_dir, "--served-model-name", name, "--host", "127.0.0.1",
                     "--port", str(self.port), "--max-model-len", str(max_model_len),
                     "--kv-cache-memory-bytes", str(kv_cache_bytes),
                     # named, never auto: on CPU vLLM's auto turns a float32 checkpoint into bfloat16, and pdserve
                     # serves a checkpoint in its own dtype
                     "--dtype", dtype,
                     # the throughput bench sends random prompts, and a warm-up prompt must not seed a cache the
                     # other system is measured without; the prefix-cache bench turns it on for both
                     "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching", "--seed", "0"]
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        self._log = open(log_path, "w")
        t0 = time.perf_counter()
        self.popen = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=env, start_new_session=True, stdin=subprocess.DEVNULL)
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            self._wait(timeout_s)
        except BaseException:
            self.close()
            raise
        self.startup_s = time.perf_counter() - t0

    def _pump(self) -> None:
        for line in self.popen.stdout:
            self._log.write(line)
            self._log.flush()
            if _KEEP.search(line):
                self.lines.append(line.strip()[:400])

    def _wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"vllm serve exited {self.popen.returncode} before it answered /health "
                                   f"(log: {self._log.name})")
            try:
                if urllib.request.urlopen(f"{self.url}/health", timeout=2).status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vllm serve did not answer /health within {timeout_s:.0f}s (log: {self._log.name})")

    def rss_bytes(self) -> int:
        return group_rss_bytes(self.popen.pid)

    def kv_cache_tokens(self) -> int | None:
        for line in self.lines:
            if m := _KV_TOKENS.search(line):
                return int(m.group(1).replace(",", ""))
        return None

    def close(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        try:  # its engine core and workers share its process group: none may outlive it and hold a core
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
