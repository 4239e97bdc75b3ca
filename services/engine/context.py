"""The attention context: how page tables reach attention without the model knowing about serving.

The runner sets it before a forward pass and resets it after; the model only reads it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .paged_attention import PagedDecode


@dataclass(slots=True)
class AttentionContext:
    is_prefill: bool
    # token i of the flattened batch is written to pool page slot_pages[i], offset slot_offsets[i]
    slot_pages: torch.Tensor      # [T] int64
    slot_offsets: torch.Tensor    # [T] int64
    # decode only: where each sequence's pages lie in the pool, computed once per step for every layer
    paged: PagedDecode | None = None
    # decode on the native CPU kernel (native.py) instead: each sequence's page table and the tokens it attends
    table: torch.Tensor | None = None  # [B, P] int64
    lens: torch.Tensor | None = None   # [B] int64
    fused: bool = False  # and rope + the K/V write + attention in one call (native.decode_attention_block)
    # prefill only: sequence b is rows cu_seqlens[b]:cu_seqlens[b + 1] of the packed batch (no padding) and
    # continues after prefix_lens[b] tokens already in the pool, on the pages prefix_pages[b]
    cu_seqlens: list[int] | None = None
    prefix_lens: list[int] | None = None
    prefix_pages: list[torch.Tensor] | None = None  # [ceil(prefix_len / page_size)] int64 each


_CONTEXT: AttentionContext | None = None


def set_context(ctx: AttentionContext) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def get_context() -> AttentionContext:
    if _CONTEXT is None:
        raise RuntimeError("attention called without an AttentionContext (runner did not set one)")
    return _CONTEXT


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = None
