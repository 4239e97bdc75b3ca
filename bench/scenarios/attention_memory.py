"""Bytes one decode step's attention allocates, pages on contiguous ids against the same batch on ids scattered
over the whole pool: `python -m pdserve.bench.scenarios.attention_memory`.

Counted op by op (services/engine/alloc_bytes.py): preparing the step (once, for every layer) plus one layer's attention (each
layer allocates as much again, freed before the next). The pool and the queries are meta tensors, so an
8B-like shape at a 1,048,576-token pool costs no memory here; the page tables are real, as the step's layout is
computed from them. Scattered ids are drawn without replacement from the whole pool (seeded), as a pool looks
after a load peak; contiguous ones are granted lowest id first.
"""
from __future__ import annotations

import argparse
import dataclasses
import random

import torch

from pdserve.engine.paged_attention import PagedDecode, paged_decode_attention, prepare_paged_decode

from pdserve.engine.alloc_bytes import AllocatedBytes

PAGE_SIZE = 16
# name: (heads, kv_heads, head_dim, KV dtype)
SHAPES = {"tiny-kv": (4, 2, 8, torch.float32), "tiny": (8, 4, 32, torch.float32),
          "8b-like": (32, 8, 128, torch.bfloat16)}


def step_bytes(pages: list[int], num_pages: int, pages_per_seq: int, heads: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype) -> tuple[int, int]:
    """(bytes allocated, rows scored) for sequences holding pages_per_seq pages each, the last one partial."""
    B = len(pages) // pages_per_seq
    table = torch.tensor(pages).view(B, pages_per_seq)
    positions = torch.tensor([(pages_per_seq - 1) * PAGE_SIZE + b % PAGE_SIZE for b in range(B)])
    cache = torch.empty(num_pages, 2, PAGE_SIZE, kv_heads, head_dim, dtype=dtype, device="meta")
    q = torch.empty(B, heads, head_dim, dtype=dtype, device="meta")
    with AllocatedBytes() as prepared:
        pd = prepare_paged_decode(table, positions, PAGE_SIZE, kv_heads, heads)
    on_meta = PagedDecode(**{f.name: getattr(pd, f.name).to("meta") if f.name != "runs" else pd.runs
                             for f in dataclasses.fields(PagedDecode)})
    with AllocatedBytes() as attended:
        paged_decode_attention(q, cache, on_meta)
    return prepared.bytes + attended.bytes, pd.num_rows


HEADER = ("| shape (heads, KV heads, D, dtype) | pool tokens | contiguous rows | contiguous MiB | scattered rows "
          "| scattered MiB | scattered / contiguous | scattered bytes per page read |\n|---|---|---|---|---|---|---|---|")


def table(pools: list[int], batch: int = 64, pages_per_seq: int = 3, shapes: tuple[str, ...] = tuple(SHAPES)
          ) -> list[str]:
    """The report's Markdown lines, one row per shape and pool size (in pages of PAGE_SIZE tokens)."""
    read = batch * pages_per_seq
    lines = [f"## Decode attention's bytes per step: {batch} sequences of {pages_per_seq} pages ({read} pages "
             "read), contiguous against scattered ids\n", HEADER]
    for name in shapes:
        shape = SHAPES[name]
        for num_pages in pools:
            cont, cont_rows = step_bytes(list(range(read)), num_pages, pages_per_seq, *shape)
            scat, scat_rows = step_bytes(random.Random(0).sample(range(num_pages), read), num_pages, pages_per_seq,
                                         *shape)
            h, kvh, d, dt = shape
            lines.append(f"| {name} ({h}, {kvh}, {d}, {str(dt).removeprefix('torch.')}) | {num_pages * PAGE_SIZE:,} "
                         f"| {cont_rows} | {cont / 2**20:.2f} | {scat_rows} | {scat / 2**20:.2f} | {scat / cont:.2f} "
                         f"| {scat / read:,.0f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m pdserve.bench.scenarios.attention_memory")
    ap.add_argument("--pools", default="65536,100000", help="pool sizes in pages of 16 tokens")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--pages-per-seq", type=int, default=3)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args(argv)
    print("\n".join(table([int(p) for p in args.pools.split(",")], args.batch, args.pages_per_seq,
                          args.shapes.split(","))))


if __name__ == "__main__":
    main()
