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
