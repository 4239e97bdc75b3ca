"""Report section and target row for the decode step against its memory-bandwidth floor."""
from __future__ import annotations

from .format import _verdict

TARGET_BATCH, TARGET_CONTEXT, TARGET_RATIO = 16, 1024, 2.0  # issue 12: within 2× of the floor at b16, c1024


def decode_step_section(res: dict) -> list[str]:
    ds = res.get("decode_step") or {}
    if "rows" not in ds:
        return []
    return ["## Decode step against its memory-bandwidth floor", "",
            f"`python -m pdserve.bench.scenarios.decode_step`'s own table (its rows also in `{ds['file']}`):", "",
            ds["table"], ""]


def decode_step_targets(res: dict) -> list[list[str]]:
    ds = res.get("decode_step") or {}
    label = (f"decode step ≤ {TARGET_RATIO:g}× its memory-bandwidth floor (batch {TARGET_BATCH}, "
             f"context {TARGET_CONTEXT})")
    if "rows" not in ds:
        why = ds.get("absent", "not run")
        return [[label, why, _verdict(None)]]
    row = next((r for r in ds["rows"] if r["batch"] == TARGET_BATCH and r["context"] == TARGET_CONTEXT), None)
    if row is None:
        got = sorted((r["batch"], r["context"]) for r in ds["rows"])
        return [[label, f"no batch {TARGET_BATCH} × context {TARGET_CONTEXT} row (has {got})", _verdict(None)]]
    return [[label, f"{row['ratio']:.2f}× ({row['step_ms']:.2f} ms vs floor {row['floor_ms']:.2f} ms)",
             _verdict(row["ratio"] <= TARGET_RATIO)]]
