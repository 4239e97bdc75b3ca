"""engine/heap.py: with the thresholds set, a prefill pass on a worker thread (as prefill runs its passes) takes
its buffers from the heap, not as fresh pages from the kernel. Counted in a child process, so the setting and
the fault counts are its own."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

CHILD = r"""
import json, sys, threading
from concurrent.futures import ThreadPoolExecutor
import torch
from pdserve.engine.heap import keep_freed_memory
from pdserve.engine.runner import ModelRunner
said = keep_freed_memory() if sys.argv[2] == "keep" else ""
torch.set_num_threads(1)
runner = ModelRunner(sys.argv[1], 64, 16)
ids, pages = [(7 * i) % 500 + 2 for i in range(512)], list(range(1, 34))
faults = lambda: int(open("/proc/thread-self/stat").read().rsplit(")", 1)[1].split()[7])
def passes():
    runner.prefill(ids, pages)  # the first pass maps what the later ones reuse
    f0 = faults()
    logits = [runner.prefill(ids, pages)[-1].argmax().item() for _ in range(4)]
    return (faults() - f0) / 4, logits
with ThreadPoolExecutor(1) as ex:
    per_pass, logits = ex.submit(passes).result()
print(json.dumps({"said": said, "faults": per_pass, "logits": logits}))
"""


def _child(model_dir: str, mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD") and
           not k.startswith("MALLOC_")}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, "-c", CHILD, model_dir, mode], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/stat") or sys.platform != "linux",
                    reason="counts faults through Linux's /proc and sets glibc's thresholds")
def test_kept_buffers_fault_no_fresh_pages_and_change_no_token(model_dir):
    kept, default = _child(model_dir, "keep"), _child(model_dir, "default")
    assert "keeps freed blocks up to 32 MiB" in kept["said"], kept["said"]
    # a 512-token pass's buffers are ~12 MiB (3,000 pages); kept, a pass maps next to none of them afresh
    assert kept["faults"] < 100, (kept, default)
    assert kept["logits"] == default["logits"]


def test_an_operators_setting_stands(monkeypatch):
    from pdserve.engine.heap import keep_freed_memory
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")
    assert keep_freed_memory() == "C heap: the operator's settings stand (GLIBC_TUNABLES)"


HEAP_CHILD = r"""
import ctypes, json
from prometheus_client import generate_latest
from pdserve.engine.heap import heap_bytes, keep_freed_memory
keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
before = heap_bytes()
block = libc.malloc(16 << 20)
ctypes.memset(block, 1, 16 << 20)
held = heap_bytes()
libc.free(block)
print(json.dumps({"before": before, "held": held, "after": heap_bytes(),
                  "exported": [l for l in generate_latest().decode().splitlines() if l.startswith("pdserve_c_heap")]}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallinfo2")
def test_the_heap_gauge_shows_a_freed_pass_buffer_kept_as_free_heap():
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD") and
           not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", HEAP_CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 1 << 20
    # 16 MiB, under the kept mmap threshold: taken from the heap, in use, then kept free rather than trimmed (the
    # other allocations of the interpreter between two readings move each by kilobytes)
    assert got["held"][0] - got["before"][0] >= 15 * mib, got
    assert got["after"][1] - got["held"][1] >= 15 * mib, got
    assert got["held"][0] - got["after"][0] >= 15 * mib, got
    assert {l.split("{")[1].split("}")[0] for l in got["exported"]} == {'state="in_use"', 'state="free"'}, got
