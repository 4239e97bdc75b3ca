"""Rotary position embedding, with the frequency scalings of Llama 3.x ("llama3") and "linear"."""
from __future__ import annotations

import math

import torch
from torch import nn


def inv_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """The per-pair rotation speeds, computed as transformers' rope initialisers do (float32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    if kind != "default":
        raise ValueError(f"rope_type {kind!r} has no implementation")  # families.py refuses it earlier
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.register_buffer("inv_freq", inv_frequencies(head_dim, theta, scaling or {}), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, signed sin: [T, 1, D] in dtype (computed in float32, then rounded, as
        transformers does), once per forward pass for every layer. The sin's first half is negated: rotating
        half of x is then a roll, (-x2) * sin being x2 * (-sin) exactly."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        half = emb.shape[-1] // 2
        sin = emb.sin()
        sin[:, :half].neg_()
        return emb.cos()[:, None, :].to(dtype), sin[:, None, :].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, transformers' rotation; x: [T, H, D]; cos, sin: RotaryEmbedding's."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
