"""Sampling profiles of the running services with py-spy (optional: skipped with a message when absent).

Each sampled stack is charged to its deepest frame in pdserve's own code (services/…), so a torch
kernel called from the model counts as `engine/model.py:forward`, and a stack with no project frame
counts under the library it sits in (grpc, asyncio, …). That answers "what dominates the time".
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^:()]+)(?::(?P<line>\d+))?\)$")


def pyspy_path() -> str | None:
    cand = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return cand if os.path.exists(cand) else shutil.which("py-spy")


def start(pid: int, seconds: float, out_path: str, rate: int = 100) -> subprocess.Popen | None:
    exe = pyspy_path()
    if exe is None:
        return None
    return subprocess.Popen([exe, "record", "--nonblocking", "-r", str(rate), "-d", str(max(1, round(seconds))),
                             "-p", str(pid), "-f", "raw", "-o", out_path],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# a thread parked here is waiting for work, not working (py-spy's idle heuristic misses some of these)
_IDLE = (("selectors.py", "select"), ("concurrent/futures/thread.py", "_worker"), ("threading.py", "wait"),
         ("queue.py", "get"))
# entry frames say nothing about where time goes: look past them to the library underneath
_ENTRY = ("services/cli.py", "/main.py", "services/launcher.py")


def _parse(frame: str) -> tuple[str, str, str] | None:
    m = _FRAME.match(frame.strip())
    return (m.group("func"), m.group("file"), m.group("line") or "?") if m else None


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Ends a recording early: py-spy writes what it has on SIGINT, as on Ctrl-C."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _where(frames: list[str]) -> str | None:
    """Where one sample's time goes; None for an idle thread."""
    parsed = [p for p in (_parse(f) for f in frames) if p]
    if not parsed:
        return "(other)"
    func, path, _ = parsed[-1]  # leaf last in py-spy's collapsed format
    if any(path.endswith(f) and func.split(".")[-1] == fn for f, fn in _IDLE):
        return None
    for func, path, line in reversed(parsed):
        i = path.find("services/")
        if i >= 0 and not any(e in path for e in _ENTRY):
            # the line says which statement: in attention, the page gather or the attention itself
            return f"{path[i + len('services/'):]}:{line} {func}"
    func, path, _ = parsed[-1]
    if path.endswith("threading.py") and func.endswith("Thread.run"):
        return "(native code on a Python thread: gRPC core, Mooncake, …)"
    if "call_soon_threadsafe" in "".join(f for f, _, _ in parsed[-3:]) or path.endswith("selector_events.py"):
        return "(worker thread handing its result to the event loop: call_soon_threadsafe)"
    for lib in ("grpc", "asyncio", "torch", "mooncake", "prometheus_client", "google/protobuf", "concurrent",
                "threading"):
        if f"{lib}/" in path or path.startswith(lib) or path.endswith(f"{lib}.py"):
            return f"({lib})"
    return f"({os.path.basename(path)})"


def summarize(path: str, top: int = 10) -> dict:
    """{samples (busy), idle, top: [(where, share of busy samples)]} for one collapsed-stack file."""
    counts: Counter[str] = Counter()
    busy = idle = 0
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                stack, _, n = line.rstrip("\n").rpartition(" ")
                if not stack or not n.isdigit():
                    continue
                where = _where(stack.split(";"))
                if where is None:
                    idle += int(n)
                else:
                    counts[where] += int(n)
                    busy += int(n)
    return {"samples": busy, "idle": idle,
            "top": [(k, v / busy) for k, v in counts.most_common(top)] if busy else []}
