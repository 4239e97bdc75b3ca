"""pdserve's transfer step on its own: PrefillWorker.write into a peer process, no forward pass, no RPC.

Between the in-service number (prefill's pdserve_kv_transfer_seconds) and raw Mooncake, this says how
much of the gap is the write step's own work (zeroing a tail, CRC-32C, building tags, two writes) and
how much is the service around it (GIL and CPU shared with the event loop and the next forward).
cProfile of the same calls splits the step by function.
"""
from __future__ import annotations

import cProfile
import os
import pstats
import time
from types import SimpleNamespace

from pdserve.common.config import pages_for
from pdserve.engine.config import ModelConfig
from pdserve.engine.kv_pool import KVPool, PoolLayout
from pdserve.prefill.worker import PrefillWorker, Target

from ..peers.mooncake_raw import RawMooncake

# (file suffix, function) -> label; cumulative time of each inside PrefillWorker.write
_PARTS = {("kv_pool.py", "zero_tail"): "zero tail", ("kv_pool.py", "checksums"): "CRC-32C",
          ("tags.py", "make_tags"): "make_tags", ("kvtransfer/engine.py", "write"): "Mooncake writes",
          ("kvtransfer/engine.py", "coalesce"): "coalesce"}


def measure(model_dir: str, prompt_len: int, raw: RawMooncake, repeats: int, checksums: bool) -> dict:
    cfg = ModelConfig.from_dir(model_dir)
    layout = PoolLayout.for_model(cfg, 16, "float32")
    n = pages_for(prompt_len, layout.page_size)
    pool = KVPool(layout, n)
    pool.kv.uniform_()  # CRC-32C time does not depend on the bytes, but a real page is not all zeros
    worker = PrefillWorker(SimpleNamespace(pool=pool), raw.engine, checksums=checksums)
    target = Target(raw.remote["session"], raw.remote["data"], raw.remote["tags"], epoch=1,
                    leases=[(i, 1) for i in range(n)])
    owner = os.urandom(16)
    pages = list(range(n))
    worker.write(owner, pages, prompt_len, target)
    times = []
    for _ in range(repeats):
        times.append(worker.write(owner, pages, prompt_len, target).seconds)
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(repeats):
        worker.write(owner, pages, prompt_len, target)
    prof.disable()
    wall = time.perf_counter() - t
    parts: dict[str, float] = {}
    for (path, _, func), (_, _, _, cum, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        for (suffix, name), label in _PARTS.items():
            if path.endswith(suffix) and func == name:
                parts[label] = parts.get(label, 0.0) + cum
    raw.engine.unregister(pool.data_ptr)
    raw.engine.unregister(pool.tag_ptr)
    times.sort()
    return {"median_s": times[len(times) // 2], "parts": {k: v / wall for k, v in parts.items()},
            "checksums": checksums, "pages": n}
