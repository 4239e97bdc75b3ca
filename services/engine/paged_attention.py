"""Decode attention read in place from the page-major pool: no per-layer copy of the sequences' pages.

A layer's pool view is [num_pages, 2, page_size, kv_heads, D] with one uniform stride between pages, so a
contiguous range of page ids is a batch of matrices that `bmm` reads where they lie. The pages of a step are
covered by a few such ranges ("runs", split at the largest gaps of unused ids: the broker grants lowest ids
first, so the live pages are dense); every page yields its scores against its owner's query, and the softmax
is taken across each sequence's pages by reductions over the owner index. A run may cover pages of nobody in
this batch (free, stale, or being written): their rows belong to a dummy owner whose results are dropped.
Only each sequence's last page is copied (one page per sequence and layer), because only it holds slots past
the sequence's length, and a weight of 0 times a stale NaN or inf would still be NaN.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_RUNS = 8        # bmm calls per operand and layer, at most
MIN_SPLIT_GAP = 16  # unused pages worth a separate call rather than a wasted slice of one


@dataclass(slots=True)
class PagedDecode:
    """Where a decode step's pages are, computed once per step and read by every layer."""
    runs: list[tuple[int, int, int]]  # (first page, end page, first row): rows row..row+end-first are those pages
    owner: torch.Tensor               # [R + B] int64: sequence of each row, B for nobody; rows R.. are the tails
    query: torch.Tensor               # [R + B] int64: the query row each page is scored with (owner, clamped)
    tail_pages: torch.Tensor          # [B] int64: each sequence's last page
    tail_valid: torch.Tensor          # [B, 1, page_size, 1, 1] bool: its slots up to the new token
    # scores that count: bias 0 and keep 1; the others: bias -1e30 and keep 0 (floats: on CPU a bool-masked
    # fill takes ~8x an add); [R + B, heads, page_size * kv_heads] float32 both
    bias: torch.Tensor
    keep: torch.Tensor


def _runs(pages: torch.Tensor) -> list[tuple[int, int]]:
    """Covers sorted distinct page ids with at most MAX_RUNS ranges, split where the most ids lie unused."""
    gaps = pages[1:] - pages[:-1] - 1
    top = torch.topk(gaps, min(MAX_RUNS - 1, gaps.numel()))
    cuts = sorted(i + 1 for g, i in zip(top.values.tolist(), top.indices.tolist()) if g >= MIN_SPLIT_GAP)
    bounds = [0, *cuts, pages.numel()]
    ids = pages.tolist()
    return [(ids[a], ids[b - 1] + 1) for a, b in zip(bounds, bounds[1:])]


def prepare_paged_decode(table: torch.Tensor, positions: torch.Tensor, page_size: int, num_kv_heads: int,
                         num_heads: int) -> PagedDecode:
    """table: [B, P] page ids (padding past each sequence's pages is never read); positions: [B]."""
    B, P = table.shape
    dev = table.device
    num_full = positions // page_size  # pages before the one the new token sits in
    full = torch.arange(P, device=dev)[None, :] < num_full[:, None]
    pages, order = table[full].sort()
    owners = torch.arange(B, device=dev)[:, None].expand(B, P)[full][order]
    tail_pages = table[torch.arange(B, device=dev), num_full]
    if pages.numel() and (pages[1:] == pages[:-1]).any():
        raise ValueError("a page appears twice among the sequences' full pages of one decode step: "
                         f"{pages.numel()} pages, {pages.unique().numel()} distinct")
    runs, row, owner = [], 0, []
    for lo, hi in _runs(pages) if pages.numel() else []:
        rows = torch.full((hi - lo,), B, dtype=torch.int64, device=dev)
        inside = (pages >= lo) & (pages < hi)
        rows[pages[inside] - lo] = owners[inside]
        runs.append((lo, hi, row))
        owner.append(rows)
        row += hi - lo
    owner = torch.cat([*owner, torch.arange(B, device=dev)])
    slot = torch.arange(page_size, device=dev)
    tail_valid = slot[None, :] <= (positions % page_size)[:, None]                      # [B, ps]
    slot_keep = torch.cat([(owner[:row] < B)[:, None].expand(row, page_size), tail_valid]).float()  # [R + B, ps]
    group = num_heads // num_kv_heads
    head_keep = (torch.arange(num_heads, device=dev)[:, None] // group == torch.arange(num_kv_heads, device=dev)).float()
    keep = (slot_keep[:, None, :, None] * head_keep[None, :, None, :]).view(row + B, num_heads, -1)  # [.., H, ps, kvh]
    return PagedDecode(runs, owner, owner.clamp(max=B - 1), tail_pages, tail_valid[:, None, :, None, None],
                       (keep - 1) * 1e30, keep)


def paged_decode_attention(q: torch.Tensor, cache: torch.Tensor, pd: PagedDecode) -> torch.Tensor:
    """q: [B, H, D] (one new token per sequence, its K/V already in the pool); cache: the layer's pool view
    [num_pages, 2, ps, kvh, D]. Returns [B, H, D]."""
    B, H, D = q.shape
    ps, kvh = cache.shape[2], cache.shape[3]
    R = pd.owner.numel() - B
    # every query head against every KV head of a page in one matmul (kvh times the few FLOPs needed, but
    # one bmm over the pool as it lies); the other heads' scores are masked with the stale slots
    qs = (q * D ** -0.5).to(cache.dtype)[pd.query]               # [R + B, H, D]
    tail = cache[pd.tail_pages].masked_fill_(~pd.tail_valid, 0)  # [B, 2, ps, kvh, D]
    scores = torch.empty(R + B, H, ps * kvh, dtype=cache.dtype, device=q.device)
    for lo, hi, row in pd.runs:
        torch.bmm(qs[row:row + hi - lo], cache[lo:hi, 0].view(hi - lo, ps * kvh, D).transpose(1, 2),
                  out=scores[row:row + hi - lo])
    torch.bmm(qs[R:], tail[:, 0].view(B, ps * kvh, D).transpose(1, 2), out=scores[R:])
    # added, not replaced: every stale K is in a tail (zeroed above) or in nobody's rows (dropped)
    scores = scores.float() + pd.bias
    owner_h = pd.owner[:, None].expand(-1, H)
    peak = torch.full((B + 1, H), float("-inf"), device=q.device).scatter_reduce_(0, owner_h, scores.amax(2), "amax")
    # exp of an input below -87 (a float32 underflow, or -inf) takes ~100x longer on x86 CPUs, and a weight
    # below e^-80 is nothing next to the peak's 1: clamped, then the masked weights are made exactly 0 (a NaN
    # stays NaN, but only nobody's rows, summed into the dropped row B, can hold one)
    w = (scores - peak[pd.owner][:, :, None]).clamp_(min=-80.0).exp_().mul_(pd.keep)
    total = torch.zeros(B + 1, H, device=q.device).index_add_(0, pd.owner, w.sum(2))
    w = w.to(cache.dtype)
    parts = torch.empty(R + B, H, D, dtype=cache.dtype, device=q.device)
    for lo, hi, row in pd.runs:
        torch.bmm(w[row:row + hi - lo], cache[lo:hi, 1].view(hi - lo, ps * kvh, D), out=parts[row:row + hi - lo])
    torch.bmm(w[R:], tail[:, 1].reshape(B, ps * kvh, D), out=parts[R:])
    out = torch.zeros(B + 1, H, D, device=q.device).index_add_(0, pd.owner, parts.float())
    return (out[:B] / total[:B, :, None]).to(q.dtype)
