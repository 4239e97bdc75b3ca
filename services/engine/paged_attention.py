"""Decode attention over exactly the pages a step reads: its memory and work follow those pages, not the pool.

A layer's pool view is [num_pages, 2, page_size, kv_heads, D] with one uniform stride between pages, so a
contiguous range of page ids is a batch of matrices that `bmm` reads where they lie. A step's full pages
(every page of a sequence before the one its new token sits in; a shared prefix page once, for its first reader)
are split into maximal runs of consecutive ids; two runs are joined across a gap of unused ids only when the gap is no longer than the run after it, so
the rows of pages nobody in this batch reads (free, stale, or being written: a dummy owner whose results are
dropped) never outnumber the pages read. The longest MAX_RUNS joined runs of at least MIN_RUN_PAGES pages are
read in place; every other full page, and each sequence's last page, is gathered into one packed copy, so
pages scattered over a pool of any size cost what they hold. Every page yields its scores against its
owner's query, and the softmax is taken across each sequence's pages by reductions over the owner index.
The last page is the only one that holds slots past its sequence's length: its copy has them zeroed, because a
weight of 0 times a stale NaN or inf would still be NaN.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_RUNS = 8        # in-place bmm calls per operand and layer, at most
MIN_SPLIT_GAP = 16  # unused pages worth a separate call rather than a wasted slice of one
MIN_RUN_PAGES = 4   # a shorter run is copied into the packed pages: one copy of a few pages beats a call


@dataclass(slots=True)
class PagedDecode:
    """Where a decode step's pages are, computed once per step and read by every layer."""
    runs: list[tuple[int, int, int]]  # (first page, end page, first row): rows row..row+end-first are those pages
    owner: torch.Tensor               # [R + N] int64: sequence of each row, B for nobody
    query: torch.Tensor               # [R + N] int64: the query row each page is scored with (owner, clamped)
    packed_pages: torch.Tensor        # [N] int64: rows R.. copied from these pages; the last B are the tails
    tail_pages: torch.Tensor          # [B] int64: each sequence's last page
    tail_valid: torch.Tensor          # [B, 1, page_size, 1, 1] bool: its slots up to the new token
    # scores that count: bias 0 and keep 1; the others: bias -1e30 and keep 0 (floats: on CPU a bool-masked
    # fill takes ~8x an add). Every row but the tails has all its slots: only a query head's own KV head
    # counts there, the same for every row ([heads, page_size * kv_heads] float32); nobody's rows need no mask,
    # their results are dropped. The tails' are [B, heads, page_size * kv_heads] float32.
    head_bias: torch.Tensor
    head_keep: torch.Tensor
    tail_bias: torch.Tensor
    tail_keep: torch.Tensor

    @property
    def num_rows(self) -> int:
        """Pages scored per layer: the pages read, plus at most as many unused ones inside in-place runs."""
        return self.owner.numel()


def _runs(pages: torch.Tensor) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """pages: sorted distinct ids. Returns the ranges read in place and a [n] bool of the pages they hold."""
    n = pages.numel()
    lo, hi = pages[0].item(), pages[-1].item() + 1
    if hi - lo == n:  # one range (one sequence on pages granted lowest id first): ~20 small ops fewer
        return ([(lo, hi)] if n >= MIN_RUN_PAGES else []), pages.new_full((n,), n >= MIN_RUN_PAGES, dtype=torch.bool)
    gaps = pages[1:] - pages[:-1] - 1
    starts = torch.cat([pages.new_zeros(1), (gaps > 0).nonzero().flatten() + 1])  # maximal consecutive runs
    lengths = torch.diff(starts, append=pages.new_full((1,), n))
    # joined across a gap only when the next run has at least as many pages: each unused row read is paid for
    # by a distinct page read, whatever the pool's size or the pages' spread
    gap = gaps[starts[1:] - 1]
    joined = torch.cat([pages.new_zeros(1, dtype=torch.bool), (gap <= MIN_SPLIT_GAP) & (gap <= lengths[1:])])
    group = torch.cumsum(~joined, 0) - 1
    live = torch.zeros(int(group[-1]) + 1, dtype=torch.int64, device=pages.device).index_add_(0, group, lengths)
    top = torch.topk(live, min(MAX_RUNS, live.numel()))
    chosen = top.indices[top.values >= MIN_RUN_PAGES]
    in_place = torch.zeros(live.numel(), dtype=torch.bool, device=pages.device)
    in_place[chosen] = True
    page_group = group.repeat_interleave(lengths)
    kept = in_place[page_group]
    first = torch.full_like(live, n).scatter_reduce_(0, page_group, torch.arange(n, device=pages.device), "amin")
    last = torch.zeros_like(live).scatter_reduce_(0, page_group, torch.arange(n, device=pages.device), "amax")
    ids = pages.tolist()
    spans = sorted((ids[a], ids[b] + 1) for a, b in zip(first[chosen].tolist(), last[chosen].tolist()))
    return spans, kept


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
    # a cached prefix page (prefix reuse) is read by every sequence that shares it: its first reader's row may
    # be read in place, each further reader's is a packed copy (a page read k times costs k rows, as it should)
    first = torch.ones_like(pages, dtype=torch.bool)
    if pages.numel() > 1:
        first[1:] = pages[1:] != pages[:-1]
    if pages.numel():
        spans, kept_first = _runs(pages[first])
    else:
        spans, kept_first = [], torch.zeros(0, dtype=torch.bool, device=dev)
    kept = torch.zeros_like(first)
    kept[first] = kept_first
    runs, row, owner = [], 0, []
    for lo, hi in spans:
        rows = torch.full((hi - lo,), B, dtype=torch.int64, device=dev)
        inside = (pages >= lo) & (pages < hi) & first
        rows[pages[inside] - lo] = owners[inside]
        runs.append((lo, hi, row))
        owner.append(rows)
        row += hi - lo
    owner = torch.cat([*owner, owners[~kept], torch.arange(B, device=dev)])
    packed_pages = torch.cat([pages[~kept], tail_pages])
    slot = torch.arange(page_size, device=dev)
    tail_valid = slot[None, :] <= (positions % page_size)[:, None]                      # [B, ps]
    group = num_heads // num_kv_heads
    head_keep = (torch.arange(num_heads, device=dev)[:, None] // group == torch.arange(num_kv_heads, device=dev)).float()
    head_keep = head_keep[:, None, :].expand(num_heads, page_size, num_kv_heads)           # [H, ps, kvh]
    tail_keep = (tail_valid[:, None, :, None] * head_keep).view(B, num_heads, -1)
    head_keep = head_keep.reshape(num_heads, -1)
    return PagedDecode(runs, owner, owner.clamp(max=B - 1), packed_pages, tail_pages,
                       tail_valid[:, None, :, None, None], (head_keep - 1) * 1e30, head_keep,
                       (tail_keep - 1) * 1e30, tail_keep)


def paged_decode_attention(q: torch.Tensor, cache: torch.Tensor, pd: PagedDecode) -> torch.Tensor:
    """q: [B, H, D] (one new token per sequence, its K/V already in the pool); cache: the layer's pool view
    [num_pages, 2, ps, kvh, D]. Returns [B, H, D]."""
    B, H, D = q.shape
    ps, kvh = cache.shape[2], cache.shape[3]
    N = pd.packed_pages.numel()
    R = pd.num_rows - N
    # every query head against every KV head of a page in one matmul (kvh times the few FLOPs needed, but
    # one bmm over the pool as it lies); the other heads' scores are masked with the stale slots
    qs = (q * D ** -0.5).to(cache.dtype)[pd.query]                # [R + N, H, D]
    packed = cache[pd.packed_pages]                                # [N, 2, ps, kvh, D]
    packed[N - B:].masked_fill_(~pd.tail_valid, 0)
    scores = torch.empty(R + N, H, ps * kvh, dtype=cache.dtype, device=q.device)
    for lo, hi, row in pd.runs:
        torch.bmm(qs[row:row + hi - lo], cache[lo:hi, 0].view(hi - lo, ps * kvh, D).transpose(1, 2),
                  out=scores[row:row + hi - lo])
    torch.bmm(qs[R:], packed[:, 0].view(N, ps * kvh, D).transpose(1, 2), out=scores[R:])
    # added, not replaced: every stale K is in a tail (zeroed above) or in nobody's rows (dropped)
    F = R + N - B
    scores = scores.float()
    scores[:F] += pd.head_bias
    scores[F:] += pd.tail_bias
    owner_h = pd.owner[:, None].expand(-1, H)
    peak = torch.full((B + 1, H), float("-inf"), device=q.device).scatter_reduce_(0, owner_h, scores.amax(2), "amax")
    # exp of an input below -87 (a float32 underflow, or -inf) takes ~100x longer on x86 CPUs, and a weight
    # below e^-80 is nothing next to the peak's 1: clamped, then the masked weights are made exactly 0 (a NaN
    # stays NaN, but only nobody's rows, summed into the dropped row B, can hold one)
    w = (scores - peak[pd.owner][:, :, None]).clamp_(min=-80.0).exp_()
    w[:F] *= pd.head_keep
    w[F:] *= pd.tail_keep
    total = torch.zeros(B + 1, H, device=q.device).index_add_(0, pd.owner, w.sum(2))
    w = w.to(cache.dtype)
    parts = torch.empty(R + N, H, D, dtype=cache.dtype, device=q.device)
    for lo, hi, row in pd.runs:
        torch.bmm(w[row:row + hi - lo], cache[lo:hi, 1].view(hi - lo, ps * kvh, D), out=parts[row:row + hi - lo])
    torch.bmm(w[R:], packed[:, 1].reshape(N, ps * kvh, D), out=parts[R:])
    out = torch.zeros(B + 1, H, D, device=q.device).index_add_(0, pd.owner, parts.float())
    return (out[:B] / total[:B, :, None]).to(q.dtype)
