"""Prefill's linears on the CPU through oneDNN, their weights reordered once into its blocked layout.

A prefill pass is GEMMs of hundreds to thousands of rows against fixed weights. MKL's sgemm (what F.linear calls)
repacks the weight on every call; oneDNN takes it packed once (`_reorder_linear_weight`) and ran the tiny model's
prefill 1.10-1.19x faster at 128-4,096 tokens on 1 and 2 threads (AMD EPYC, AVX-512), logits within 2e-5 and the
same argmax. The packed tensor replaces the plain one, so weights take no more memory; only a process that never
runs a decode step packs (decode's native step reads the plain layout).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def why_not(weight: torch.Tensor) -> str | None:
    """None when oneDNN takes this weight, else why not (the line for the start-up log)."""
    if weight.device.type != "cpu":
        return f"weights on {weight.device.type}"
    if not torch.backends.mkldnn.is_available():
        return "torch without oneDNN"
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "bfloat16 weights on a CPU without oneDNN's bfloat16"
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return f"{weight.dtype} weights"
    return None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> the same values in oneDNN's layout (an mkldnn tensor: linear() alone reads it)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, for a weight plain or packed; x: [T, in]."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class PackedLinear(nn.Module):
    """An nn.Linear whose weight was packed (its plain weight is gone)."""

    def __init__(self, plain: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = plain.in_features, plain.out_features
        self.register_buffer("weight", pack(plain.weight), persistent=False)
        self.bias = plain.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class PackedAway(nn.Module):
    """Where a linear was before its weight became part of a packed fused one: calling it is a bug, not a zero."""

    def __init__(self, name: str, into: str):
        super().__init__()
        self.name, self.into = name, into

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{self.name}'s weight was packed into {self.into}: call that instead")
