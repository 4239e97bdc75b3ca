"""Bench step: the decode step against its memory-bandwidth floor, from `python -m pdserve.bench.scenarios.decode_step`.

That module (bench/scenarios/decode_step.py) measures; this step runs it in its own process, keeps its Markdown table
and its JSON rows {batch, context, step_ms, floor_ms, ratio} for the report, and says so where it is absent.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

from ..harness.common import RESULTS, ROOT, log

ROW_KEYS = ("batch", "context", "step_ms", "floor_ms", "ratio")


def read_rows(path: str) -> list[dict]:
    """The JSON rows decode_step wrote (a list, or {"rows": [...]}), each checked for the agreed keys."""
    with open(path) as f:
        doc = json.load(f)
    rows = doc.get("rows") if isinstance(doc, dict) else doc
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{path}: expected a non-empty list of rows (or {{'rows': [...]}}), got {type(doc).__name__}")
    for i, r in enumerate(rows):
        missing = [k for k in ROW_KEYS if k not in r]
        if missing:
            raise ValueError(f"{path}: row {i} lacks {missing} (has {sorted(r)})")
    return rows


class DecodeStepStep:
    """Mixed into Bench (uses its plan and res)."""

    def decode_step(self) -> None:
        if importlib.util.find_spec("pdserve.bench.scenarios.decode_step") is None:
            self.res["decode_step"] = {"absent": "bench/scenarios/decode_step.py is not in this tree"}
            log("decode step: skipped, bench/scenarios/decode_step.py is not in this tree")
            return
        path = os.path.join(RESULTS, f"decode-step-{self.plan.mode}.json")
        log("decode step against its memory-bandwidth floor (python -m pdserve.bench.scenarios.decode_step) ...")
        # quick: the target cell and its neighbours on the tiny checkpoint; full: every batch, context and preset
        grid = ["--presets", "tiny", "--batches", "1,16", "--contexts", "128,1024", "--reps", "5"] \
            if self.plan.mode == "quick" else []
        out = subprocess.run([sys.executable, "-m", "pdserve.bench.scenarios.decode_step", "--json", path, *grid],
                             capture_output=True, text=True, cwd=ROOT, timeout=900, stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            raise RuntimeError(f"decode_step exited {out.returncode}: {out.stderr[-2000:]}")
        self.res["decode_step"] = {"rows": read_rows(path), "table": out.stdout.strip(),
                                   "file": os.path.relpath(path, ROOT)}
