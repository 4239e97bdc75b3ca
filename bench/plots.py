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
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{preset}, prompt {n}")
        ax.set_xlabel("concurrency")
        ax.set_ylabel("ms")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Latency against concurrency (solid: time to first token, dashed: inter-token)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{preset}: output tokens/s")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("output tokens/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle("Throughput against prompt length")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
        p50 = [(c["bytes"], c["bytes"] / c["p50_s"] / 1e9) for c in pts if _ok(c.get("p50_s"))]
        if p50:
            ax.plot([p[0] for p in p50], [p[1] for p in p50], color=color, marker="o", linestyle="",
                    label=f"pdserve in service, p50 ({label})")
        ax.plot([c["bytes"] for c in pts], [c["bytes"] / c["pdserve_s"] / 1e9 for c in pts], color=color, marker="v",
                linestyle="", label=f"pdserve in service, mean ({label})")
        alone = [(c["bytes"], c["bytes"] / c["write_path"]["median_s"] / 1e9) for c in pts if c.get("write_path")]
        if alone:
            ax.plot([a[0] for a in alone], [a[1] for a in alone], color=color, marker="D", fillstyle="none",
                    linestyle="", label=f"pdserve write step alone ({label})")
    for c in cells:
        if _ok(c.get("p50_s")):
            ax.annotate(f"{c['preset']} {c['prompt_len']}", (c["bytes"], c["bytes"] / c["p50_s"] / 1e9),
                        fontsize=6, xytext=(3, -8), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per request (one transfer)")
    ax.set_ylabel("GB/s")
    ax.set_title("KV transfer bandwidth against bytes (Mooncake tcp, loopback)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(res: dict, out_dir: str) -> list[str]:
    mode = res["mode"]
    out = []
    for name, fn in (("latency", latency_vs_concurrency), ("throughput", throughput_vs_prompt),
                     ("transfer", transfer_vs_bytes)):
        path = os.path.join(out_dir, f"bench-{mode}-{name}.png")
        try:
            fn(res, path)
            out.append(path)
        except Exception as e:  # noqa: BLE001 - a plot that cannot be drawn does not lose the tables
            print(f"plot {name} failed: {type(e).__name__}: {e}", flush=True)
    return out
