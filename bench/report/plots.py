"""PNG plots of a bench result (needs matplotlib: the `bench` extra). Importing this raises ImportError without it."""
from __future__ import annotations

import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"pdserve": ("tab:blue", "o"), "co-located": ("tab:orange", "s"), "transformers": ("tab:green", "^")}


def _ok(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def _log_axes(ax, title: str, xlabel: str, ylabel: str, log_y: bool = True) -> None:
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)


def _save(fig, path: str, title: str | None = None) -> None:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def latency_vs_concurrency(res: dict, path: str) -> None:
    runs = res["runs"]
    panels = sorted({(r["preset"], r["prompt_len"]) for r in runs if r["system"] != "transformers"},
                    key=lambda k: (k[0] != "tiny", k[1]))
    cols = min(3, len(panels))
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 3.8 * rows_n), squeeze=False)
    for ax, (preset, n) in zip(axes.flat, panels):
        for system in ("pdserve", "co-located"):
            pts = sorted((r["concurrency"], r["ttft_p50"], r["itl_p50"]) for r in runs
                         if r["system"] == system and r["preset"] == preset and r["prompt_len"] == n)
            if not pts:
                continue
            color, marker = STYLE[system]
            ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], color=color, marker=marker, label=f"{system} TTFT p50")
            ax.plot([p[0] for p in pts], [p[2] * 1e3 for p in pts], color=color, marker=marker, linestyle="--",
                    label=f"{system} ITL p50")
        hf = [r for r in runs if r["system"] == "transformers" and r["preset"] == preset and r["prompt_len"] == n]
        if hf:
            color, marker = STYLE["transformers"]
            ax.plot([1], [hf[0]["ttft_p50"] * 1e3], color=color, marker=marker, linestyle="", label="transformers TTFT p50")
            ax.plot([1], [hf[0]["itl_p50"] * 1e3], color=color, marker="v", linestyle="", label="transformers ITL p50")
        _log_axes(ax, f"{preset}, prompt {n}", "concurrency", "ms")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    _save(fig, path, "Latency against concurrency (solid: time to first token, dashed: inter-token)")


def throughput_vs_prompt(res: dict, path: str) -> None:
    runs = res["runs"]
    presets = sorted({r["preset"] for r in runs}, key=lambda p: p != "tiny")
    fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 4.2), squeeze=False)
    for ax, preset in zip(axes.flat, presets):
        for system in ("pdserve", "co-located"):
            color, marker = STYLE[system]
            concs = sorted({r["concurrency"] for r in runs if r["system"] == system and r["preset"] == preset})
            for c, ls in zip(concs, ("-", "--", "-.", ":")):
                pts = sorted((r["prompt_len"], r["out_tok_s"]) for r in runs
                             if r["system"] == system and r["preset"] == preset and r["concurrency"] == c)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker, linestyle=ls,
                        label=f"{system} c={c}")
        pts = sorted((r["prompt_len"], r["out_tok_s"]) for r in runs
                     if r["system"] == "transformers" and r["preset"] == preset)
        if pts:
            color, marker = STYLE["transformers"]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker, label="transformers (serial)")
        _log_axes(ax, f"{preset}: output tokens/s", "prompt tokens", "output tokens/s")
        ax.legend(fontsize=7, ncol=2)
    _save(fig, path, "Throughput against prompt length")


def _median(cell: dict):
    """In-service transfer median: exact per-request samples, or the bucket-interpolated p50 of older runs."""
    return cell.get("median_s", cell.get("p50_s"))


def transfer_vs_bytes(res: dict, path: str) -> None:
    t = res["transfer"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sweep = t.get("raw_sweep") or []
    if sweep:
        ax.plot([s["bytes"] for s in sweep], [s["bytes"] / s["median_s"] / 1e9 for s in sweep], color="gray",
                marker=".", label="raw Mooncake, one entry")
    cells = t.get("cells") or []
    if cells:
        ax.plot([c["bytes"] for c in cells], [c["bytes"] / c["raw_s"] / 1e9 for c in cells], color="black", marker="x",
                linestyle="", markersize=9, label="raw Mooncake, pdserve's bytes (data + tags)")
    for checksums, color, label in ((True, "tab:blue", "checksums on"), (False, "tab:cyan", "--no-transfer-checksum")):
        pts = [c for c in cells if c["checksums"] == checksums]
        if not pts:
            continue
        med = [(c["bytes"], c["bytes"] / _median(c) / 1e9) for c in pts if _ok(_median(c))]
        if med:
            ax.plot([p[0] for p in med], [p[1] for p in med], color=color, marker="o", linestyle="",
                    label=f"pdserve in service, median ({label})")
        ax.plot([c["bytes"] for c in pts], [c["bytes"] / c["pdserve_s"] / 1e9 for c in pts], color=color, marker="v",
                linestyle="", label=f"pdserve in service, mean ({label})")
        alone = [(c["bytes"], c["bytes"] / c["write_path"]["median_s"] / 1e9) for c in pts if c.get("write_path")]
        if alone:
            ax.plot([a[0] for a in alone], [a[1] for a in alone], color=color, marker="D", fillstyle="none",
                    linestyle="", label=f"pdserve write step alone ({label})")
    for c in cells:
        if _ok(_median(c)):
            ax.annotate(f"{c['preset']} {c['prompt_len']}", (c["bytes"], c["bytes"] / _median(c) / 1e9),
                        fontsize=6, xytext=(3, -8), textcoords="offset points")
    _log_axes(ax, "KV transfer bandwidth against bytes (Mooncake tcp, loopback)", "bytes per request (one transfer)",
              "GB/s", log_y=False)
    ax.legend(fontsize=7)
    _save(fig, path)


def load_sweep(res: dict, path: str) -> None:
    sweeps = res.get("sweep", [])
    if not sweeps:
        raise ValueError("no load sweep in this result")
    fig, axes = plt.subplots(len(sweeps), 2, figsize=(10, 3.8 * len(sweeps)), squeeze=False)
    for (ax_t, ax_g), sw in zip(axes, sweeps):
        for system in ("pdserve", "co-located"):
            lv = sorted((x for x in sw["levels"] if x["system"] == system), key=lambda x: x["multiple"])
            color, marker = STYLE[system]
            m = [x["multiple"] for x in lv]
            ax_t.plot(m, [x["summary"]["ttft_p50"] * 1e3 for x in lv], color=color, marker=marker,
                      label=f"{system} TTFT p50")
            ax_t.plot(m, [x["summary"]["ttft_p99"] * 1e3 for x in lv], color=color, marker=marker, linestyle="--",
                      label=f"{system} TTFT p99")
            ax_g.plot(m, [x["goodput"]["goodput_req_s"] for x in lv], color=color, marker=marker, label=system)
        ax_t.axhline(sw["slo_s"] * 1e3, color="gray", linestyle=":", label="SLO")
        _log_axes(ax_t, f"{sw['preset']}, prompt {sw['prompt_len']}: TTFT (requests that got one)",
                  "offered load × saturation", "ms")
        _log_axes(ax_g, f"goodput (TTFT ≤ {sw['slo_s'] * 1e3:.0f} ms)", "offered load × saturation", "req/s",
                  log_y=False)
        ax_t.legend(fontsize=7)
        ax_g.legend(fontsize=7)
    _save(fig, path, "Open loop, Poisson arrivals: latency and goodput against offered load")


def write_plots(res: dict, out_dir: str) -> list[str]:
    mode = res["mode"]
    out = []
    for name, fn in (("latency", latency_vs_concurrency), ("throughput", throughput_vs_prompt),
                     ("transfer", transfer_vs_bytes), ("load", load_sweep)):
        path = os.path.join(out_dir, f"bench-{mode}-{name}.png")
        if name == "load" and not res.get("sweep"):
            continue  # a result from before the sweep existed
        try:
            fn(res, path)
            out.append(path)
        except Exception as e:  # noqa: BLE001 - a plot that cannot be drawn does not lose the tables
            print(f"plot {name} failed: {type(e).__name__}: {e}", flush=True)
    return out
