"""Greedy and temperature/top-p sampling with a per-request seed.

The draw for step i of a request depends only on (seed, i), so prefill (step 0) and decode
(steps 1..) on different machines give the same tokens as a single process would.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 16
    ignore_eos: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _step_generator(seed: int, step: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) & ((1 << 63) - 1))
    return g


def sample_one(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    # logits: [V] float32
    if params.is_greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return int(torch.multinomial(probs, 1, generator=_step_generator(params.seed, step)))


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    # logits: [B, V]; greedy rows share one arg-max
    out = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    if greedy:
        ids = torch.argmax(logits[greedy], dim=-1).tolist()
        for i, t in zip(greedy, ids):
            out[i] = t
    for i, p in enumerate(params):
        if not p.is_greedy:
            out[i] = sample_one(logits[i], p, steps[i])
    return out
