"""Qwen3-MoE's sparse feed-forward: a softmax router picks the top-k experts of each token.

Experts are separate SwiGLU MLPs named `experts.{i}.{gate,up,down}_proj`, the tensor names of hub checkpoints
and of what transformers 5 writes on save (it fuses them into 3-D tensors only in memory).
"""
from __future__ import annotations

import torch
from torch import nn


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg, mlp_cls):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList([mlp_cls(cfg, cfg.moe_intermediate_size) for _ in range(cfg.num_experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        return out
