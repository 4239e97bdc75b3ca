"""How big a KV pool is: bytes per token from the config and the KV dtype, and the tokens a memory budget holds.

Plain arithmetic on a ModelConfig, no allocation: a pre-deploy check can say what a service would do from a
config.json alone.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..common import capacity
from .config import ModelConfig

# binary units as vLLM and Kubernetes write them (4GiB), decimal ones as disks are sold (4GB)
UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
         "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30,
         "ti": 2**40, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '1.5GB', '1048576' -> bytes; ValueError naming the text otherwise."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise ValueError(f"{text!r} is not a size in bytes (e.g. 4GiB, 512MiB, 2GB, 1048576)")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str) -> int:
    """K and V of every layer for one token: what a pool page of page_size tokens holds page_size times."""
    return capacity.kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, kv_dtype)


def pool_tokens_for(memory_bytes: int, cfg: ModelConfig, kv_dtype: str, page_size: int) -> int:
    """Whole pages only: the tokens of the pages that fit in memory_bytes (the pool's data; its tags live on
    the host beside it, 80 bytes a page: engine.tags.TAG_NBYTES)."""
    return memory_bytes // (kv_bytes_per_token(cfg, kv_dtype) * page_size) * page_size


class PoolSizeError(ValueError):
    """A pool size that cannot be served (no page fits, a fraction off CUDA): a service exits with the line."""


@dataclass(slots=True)
class PoolSize:
    """Exactly one of the three decides the pool: tokens, a memory budget, or (CUDA) a fraction of the device
    memory left once the weights are loaded."""
    tokens: int = 0
    memory_bytes: int = 0
    gpu_memory_utilization: float = 0.0

    def __post_init__(self):
        given = [n for n, v in (("tokens", self.tokens), ("memory_bytes", self.memory_bytes),
                                ("gpu_memory_utilization", self.gpu_memory_utilization)) if v]
        if len(given) != 1:
            raise ValueError(f"a pool size needs exactly one of tokens, memory_bytes, gpu_memory_utilization; "
                             f"got {given or 'none'}")
        if self.gpu_memory_utilization and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tokens < 0 or self.memory_bytes < 0:
            raise ValueError(f"a pool size cannot be negative: tokens {self.tokens}, bytes {self.memory_bytes}")

    @property
    def source(self) -> str:
        if self.tokens:
            return f"--pool-tokens {self.tokens}"
        if self.memory_bytes:
            return f"--kv-cache-memory {self.memory_bytes} bytes"
        return f"--gpu-memory-utilization {self.gpu_memory_utilization}"

    def num_pages(self, cfg: ModelConfig, kv_dtype: str, page_size: int, free_device_bytes: int | None) -> int:
        """free_device_bytes: what the device has left after the weights (None off CUDA, where a fraction of it
        means nothing and is refused)."""
        if self.tokens:
            return self.tokens // page_size
        budget = self.memory_bytes
        if self.gpu_memory_utilization:
            if free_device_bytes is None:
                raise PoolSizeError("--gpu-memory-utilization needs a CUDA device; size the pool with --pool-tokens or "
                                 "--kv-cache-memory")
            budget = int(self.gpu_memory_utilization * free_device_bytes)
        pages = pool_tokens_for(budget, cfg, kv_dtype, page_size) // page_size
        if pages < 1:
            raise PoolSizeError(f"{self.source} gives a KV budget of {budget} bytes, less than one page "
                             f"({kv_bytes_per_token(cfg, kv_dtype) * page_size} bytes: {page_size} tokens of "
                             f"{kv_bytes_per_token(cfg, kv_dtype)} bytes in {kv_dtype})")
        return pages
