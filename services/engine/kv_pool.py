"""The paged KV pool: one page-major tensor plus a separate tag region.

Layout [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim], so one page is one contiguous
byte range: one registered transfer region per pool and one transfer entry per run of pages.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig
from .dtypes import DTYPES
from .tags import TAG_NBYTES, TAG_WORDS, page_checksum, page_checksums


@dataclass(slots=True)
class PoolLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def page_nbytes(self) -> int:
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize

    @classmethod
    def for_model(cls, cfg: ModelConfig, page_size: int, dtype: str) -> "PoolLayout":
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, page_size, dtype)


class KVPool:
    def __init__(self, layout: PoolLayout, num_pages: int, device: torch.device | str = "cpu"):
        if num_pages <= 0:
            raise ValueError(f"a KV pool needs at least one page, got {num_pages}")
        self.layout = layout
        self.num_pages = num_pages
        # tags live on the host even when pages are on a GPU: they are checked by Python every step
        self.kv = torch.zeros((num_pages, layout.num_layers, 2, layout.page_size, layout.num_kv_heads,
                               layout.head_dim), dtype=layout.torch_dtype, device=device)
        self.tags = torch.zeros((num_pages, TAG_WORDS), dtype=torch.int64)

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.layout.page_size

    @property
    def page_nbytes(self) -> int:
        return self.layout.page_nbytes

    @property
    def data_ptr(self) -> int:
        return self.kv.data_ptr()

    @property
    def data_nbytes(self) -> int:
        return self.num_pages * self.page_nbytes

    @property
    def tag_ptr(self) -> int:
        return self.tags.data_ptr()

    @property
    def tag_nbytes(self) -> int:
        return self.num_pages * TAG_NBYTES

    def page_addr(self, page: int) -> int:
        return self.data_ptr + page * self.page_nbytes

    def tag_addr(self, page: int) -> int:
        return self.tag_ptr + page * TAG_NBYTES

    def checksum(self, page: int) -> int:
        return page_checksum(self.kv[page])

    def checksums(self, pages: list[int]) -> list[int]:
        return page_checksums(self.kv, pages)

    def zero_tail(self, page: int, num_tokens: int) -> None:
        """Zeroes token slots [num_tokens, page_size) so no stale bytes leave with a partial page."""
        if num_tokens < self.page_size:
            self.kv[page, :, :, num_tokens:] = 0

    def fill(self, pages: list[int], byte: int) -> None:
        """Fills pages with a marker byte (canary tests)."""
        for p in pages:
            self.kv[p].view(torch.uint8).fill_(byte)
