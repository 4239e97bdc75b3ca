"""ModelRunner: packs prefill and decode batches for the model and runs them over a KVPool."""
from __future__ import annotations

import os
import sys

import torch

from .context import AttentionContext, reset_context, set_context
from .kv_pool import DTYPES, KVPool, PoolLayout
from .loader import load_model
from .paged_attention import prepare_paged_decode


def set_threads(n: int = 0, switch_interval_ms: float | None = None) -> None:
    """Intra-op CPU threads; by default half the cores, since prefill and decode usually share a host.
    The model runs in a worker thread beside the event loop that streams tokens and answers RPCs; it
    drops the GIL inside every torch op and must get it back between ops, which can take a whole switch
    interval while the loop runs Python, so a service sets a short one."""
    torch.set_num_threads(n or max(1, (os.cpu_count() or 2) // 2))
    if switch_interval_ms is not None:
        sys.setswitchinterval(switch_interval_ms / 1000)


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ModelRunner:
    def __init__(self, model_dir: str, num_pages: int, page_size: int, dtype: str = "float32",
                 device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else pick_device()
        self.model = load_model(model_dir, self.device, DTYPES[dtype])
        self.config = self.model.config
        self.layout = PoolLayout.for_model(self.config, page_size, dtype)
        self.pool = KVPool(self.layout, num_pages, self.device)
        self.model.bind_kv_pool(self.pool.kv)

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    def _check_window(self, last_position: int) -> None:
        """Past a sliding window attention would differ from the full attention computed here: refuse."""
        window = self.config.sliding_window
        if window and last_position >= window:
            raise ValueError(f"position {last_position} is past the model's sliding_window {window}; the served "
                             f"context is capped at {window} tokens")

    def _tensor(self, data) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.int64, device=self.device)

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], pages: list[int], all_logits: bool = False) -> torch.Tensor:
        """Runs one prompt from position 0, writing its KV into `pages`; returns logits [T or 1, V]."""
        n, ps = len(token_ids), self.page_size
        if len(pages) * ps < n:
            raise ValueError(f"{len(pages)} pages of {ps} tokens cannot hold {n} tokens")
        self._check_window(n - 1)
        positions = torch.arange(n, device=self.device)
        page_of = self._tensor(pages)[positions // ps]
        set_context(AttentionContext(True, page_of, positions % ps))
        try:
            hidden = self.model(self._tensor(token_ids), positions)
        finally:
            reset_context()
        return self.model.compute_logits(hidden if all_logits else hidden[-1:])

    @torch.inference_mode()
    def decode(self, token_ids: list[int], positions: list[int], page_tables: list[list[int]]
               ) -> torch.Tensor:
        """One step for B sequences: token b sits at positions[b]; returns logits [B, V]."""
        ps = self.page_size
        B = len(token_ids)
        self._check_window(max(positions))
        short = [(b, len(t), p) for b, (t, p) in enumerate(zip(page_tables, positions)) if len(t) <= p // ps]
        if short:
            b, n, p = short[0]
            raise ValueError(f"sequence {b}: {n} pages of {ps} tokens cannot hold position {p}")
        table = torch.zeros((B, max(len(t) for t in page_tables)), dtype=torch.int64)
        for b, t in enumerate(page_tables):
            table[b, :len(t)] = torch.tensor(t, dtype=torch.int64)
        table, pos = table.to(self.device), self._tensor(positions)
        paged = prepare_paged_decode(table, pos, ps, self.config.num_key_value_heads,
                                     self.config.num_attention_heads)
        set_context(AttentionContext(False, paged.tail_pages, pos % ps, paged=paged))
        try:
            hidden = self.model(self._tensor(token_ids), pos)
        finally:
            reset_context()
        return self.model.compute_logits(hidden)
