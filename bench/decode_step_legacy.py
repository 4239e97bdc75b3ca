"""The decode attention before issue 12, kept callable for decode_step's side-by-side "before" column only:
every page of every sequence gathered into a padded [B, S, ...] copy per layer, then masked."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from unittest import mock

import torch


@dataclass(slots=True)
class LegacyTables:
    tail_pages: torch.Tensor                             # [B]: the page each new token is written to
    page_tables: torch.Tensor                            # [B, P], padded with page 0
    attn_mask: torch.Tensor                              # [B, 1, 1, P*page_size] bool, True = attend
    hidden_slots: tuple[torch.Tensor, torch.Tensor]      # (sequence, slot) pairs of ~attn_mask


def prepare(table: torch.Tensor, pos: torch.Tensor, page_size: int, num_kv_heads: int, num_heads: int
            ) -> LegacyTables:
    B, P = table.shape
    mask = torch.arange(P * page_size, device=table.device)[None, :] <= pos[:, None]
    return LegacyTables(table[torch.arange(B, device=table.device), pos // page_size], table,
                        mask[:, None, None, :], (~mask).nonzero(as_tuple=True))


def attention(q: torch.Tensor, cache: torch.Tensor, ctx: LegacyTables) -> torch.Tensor:
    B, H, D = q.shape
    kvh = cache.shape[3]
    g = H // kvh
    ks = cache[ctx.page_tables, 0].view(B, -1, kvh * D)  # [B, S, kvh*D], a contiguous copy
    vs = cache[ctx.page_tables, 1].view(B, -1, kvh * D)
    S = ks.shape[1]
    vs[ctx.hidden_slots] = 0
    scores = torch.bmm(q.view(B, kvh * g, D), ks.view(B, S * kvh, D).transpose(1, 2))
    scores = scores.view(B, kvh, g, S, kvh).diagonal(dim1=1, dim2=4)  # [B, g, S, kvh]
    scores = (scores * D ** -0.5).masked_fill_(~ctx.attn_mask.view(B, 1, S, 1), float("-inf"))
    w = torch.softmax(scores, dim=2).permute(0, 3, 1, 2).reshape(B, kvh * g, S).to(vs.dtype)
    o = torch.bmm(w, vs).view(B, kvh, g, kvh, D).diagonal(dim1=1, dim2=3)  # [B, g, D, kvh]
    return o.permute(0, 3, 1, 2).to(q.dtype)  # [B, kvh, g, D]: query head h*g + i


@contextlib.contextmanager
def legacy_decode():
    """ModelRunner.decode runs the old attention inside this block."""
    with mock.patch("pdserve.engine.runner.prepare_paged_decode", prepare), \
            mock.patch("pdserve.engine.model.paged_decode_attention", attention):
        yield
