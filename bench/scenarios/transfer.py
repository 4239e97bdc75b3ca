"""Bench step after the presets: the KV transfer in service against raw Mooncake and the write step alone."""
from __future__ import annotations

import math
import os
import sys

from ..harness.common import log


class TransferSteps:
    """The raw Mooncake comparison; mixed into Bench (uses its plan and the probe / run results in res)."""

    def transfer(self) -> None:
        # per (preset, prompt, checksums): the probe runs (else every run at the lowest concurrency seen), pooled
        groups: dict[tuple, list[dict]] = {}
        for r in self.res["probe"] or self.res["runs"] + self.res["ab"]:
            if r["system"].startswith("pdserve") and r["extra"].get("transfer_count"):
                groups.setdefault((r["preset"], r["prompt_len"], r["extra"]["checksums"]), []).append(r)
        if not groups:
            return
        log("raw Mooncake: the same bytes, process to process, no forward pass, no checksum; and prefill's "
            "write step alone")
        with _quiet_stderr():  # Mooncake's glog writes to fd 2 directly; our progress goes to stdout
            self._transfer(groups)

    def _transfer(self, groups) -> None:
        from ..peers.mooncake_raw import TAG_NBYTES, RawMooncake
        from .writepath import measure as write_path

        raw = RawMooncake(64 << 20)
        try:
            out = []
            for (preset, n, checksums), rs in sorted(groups.items()):
                c = min(r["concurrency"] for r in rs)
                rs = [r for r in rs if r["concurrency"] == c]
                count = sum(r["extra"]["transfer_count"] for r in rs)
                per_req = sum(r["extra"]["transfer_bytes"] for r in rs) / count
                pages = -(-n // 16)
                # small transfers are quick and noisy: more repeats for them
                reps = max(self.plan.raw_repeats, min(50, int(32e6 / per_req)))
                ts = sorted(raw.measure(int(per_req - pages * TAG_NBYTES), pages * TAG_NBYTES, reps))
                # paced like the probe: one transfer after each idle gap (capped: the wake-up cost stops growing)
                gap = min(0.1, sum(r["ttft_mean"] for r in rs) / len(rs))
                paced = sorted(raw.measure(int(per_req - pages * TAG_NBYTES), pages * TAG_NBYTES, 20, gap_s=gap))
                # each probe request made one transfer and the metrics were read around it: exact samples
                samples = sorted(r["extra"]["transfer_sum"] / r["extra"]["transfer_count"] for r in rs
                                 if r["extra"]["transfer_count"])
                wp = write_path(self.res["models_abs"][preset], n, raw, reps, checksums)
                buckets: dict[str, float] = {}
                for r in rs:
                    for le, v in r["extra"].get("transfer_buckets", {}).items():
                        buckets[le] = buckets.get(le, 0.0) + v
                row = {"preset": preset, "prompt_len": n, "checksums": checksums, "bytes": per_req, "pages": pages,
                       "concurrency": c, "num_transfers": count, "p50_s": hist_quantile(buckets, 0.5),
                       "pdserve_s": sum(r["extra"]["transfer_sum"] for r in rs) / count,
                       "checksum_s": sum(r["extra"]["prefill_checksum_sum"] for r in rs) / count,
                       "raw_s": ts[len(ts) // 2], "raw_all": ts, "write_path": wp,
                       "raw_paced_s": paced[len(paced) // 2], "raw_paced_mean_s": sum(paced) / len(paced),
                       "raw_paced_gap_s": gap, "median_s": samples[len(samples) // 2] if samples else float("nan")}
                out.append(row)
                log(f"  {preset} prompt {n} ({per_req / 1e6:.2f} MB, checksums {'on' if checksums else 'off'}): "
                    f"in service {per_req / row['pdserve_s'] / 1e9:.2f} GB/s, write step alone "
                    f"{per_req / wp['median_s'] / 1e9:.2f} GB/s, raw {per_req / row['raw_s'] / 1e9:.2f} GB/s "
                    f"back to back, {per_req / row['raw_paced_s'] / 1e9:.2f} GB/s paced")
            self.res["transfer"]["cells"] = out
            # one entry in one batch call, up to the write unit: pdserve never posts a larger call (a larger one
            # would be refused: the landing bound covers only calls of at most the unit)
            sweep = []
            for nb in (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, raw.engine.max_write_bytes):
                ts = sorted(raw.measure(nb, 0, max(self.plan.raw_repeats, min(50, int(32e6 / nb)))))
                sweep.append({"bytes": nb, "median_s": ts[len(ts) // 2]})
            self.res["transfer"]["raw_sweep"] = sweep
            log("  sweep: " + ", ".join(f"{s['bytes'] >> 10} KiB {s['bytes'] / s['median_s'] / 1e9:.2f} GB/s"
                                        for s in sweep))
        finally:
            raw.close()


def hist_quantile(buckets: dict[str, float], q: float) -> float:
    """Prometheus-style quantile from cumulative bucket counts {le: count}, linear within a bucket."""
    edges = sorted((float(le), c) for le, c in buckets.items())
    if not edges or edges[-1][1] <= 0:
        return math.nan
    rank = q * edges[-1][1]
    lo_edge, lo_count = 0.0, 0.0
    for edge, count in edges:
        if count >= rank:
            if math.isinf(edge):
                return lo_edge
            return lo_edge + (edge - lo_edge) * (rank - lo_count) / max(count - lo_count, 1e-12)
        lo_edge, lo_count = edge, count
    return lo_edge


class _quiet_stderr:
    """Points fd 2 at /dev/null for a while (C++ libraries log there directly)."""

    def __enter__(self):
        sys.stderr.flush()
        self._saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc):
        os.dup2(self._saved, 2)
        os.close(self._saved)
        return False
