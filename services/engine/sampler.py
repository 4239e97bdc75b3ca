"""Greedy and temperature/top-p sampling with a per-request seed.

The draw for step i of a request depends only on (seed, i), so prefill (step 0) and decode
(steps 1..) on different machines give the same tokens as a single process would.

Numerically safe for every admitted value (temperature finite and >= 0, top_p in (0, 1]): a temperature
below GREEDY_BELOW is greedy, the logits are shifted by their maximum before they are scaled, so nothing
can overflow to +inf, and probabilities that are still not finite (the model's own logits were) raise
SamplingError for that row alone: `sample` returns it in the row's place and the rest of the batch is drawn.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# below this a temperature is greedy (vLLM's _SAMPLING_EPS): 1/T would overflow float32 for T under ~3e-39,
# and logits / 5e-38 already overflow once a logit passes 17; far above that, the distribution is one-hot
# anyway for any logit gap float32 can resolve
GREEDY_BELOW = 1e-5


class SamplingError(Exception):
    """One row's sampling failed; the caller ends that sequence alone."""


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 16
    ignore_eos: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _step_generator(seed: int, step: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) & ((1 << 63) - 1))
    return g


def _probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    # logits: [V] -> probabilities [V]; (x - max) <= 0, so x / T can only underflow towards -inf (weight 0),
    # never overflow: the arg-max keeps weight exp(0) = 1 and the sum is >= 1
    x = logits.float().cpu()
    probs = torch.softmax((x - x.max()) / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p; the first token always stays, stated outright:
        # "0 < top_p" alone fails for a top_p that rounds to 0 in float32 (3e-293 passes admission as a double)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p
        keep[0] = True
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return probs


def _draw(probs: torch.Tensor, params: SamplingParams, step: int) -> int:
    return int(torch.multinomial(probs, 1, generator=_step_generator(params.seed, step)))


def sample_one(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    # logits: [V] float32
    if params.is_greedy:
        return int(torch.argmax(logits))
    probs = _probs(logits, params)
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
        raise SamplingError(f"logits give no valid distribution (max logit {float(logits.max())}, temperature "
                            f"{params.temperature}, top_p {params.top_p}): the model's logits are not finite")
    try:
        tok = _draw(probs, params, step)
    except RuntimeError as e:
        raise SamplingError(f"drawing a token failed: {e}") from e
    if not 0 <= tok < logits.shape[-1]:
        raise SamplingError(f"drew token {tok} outside the vocabulary of {logits.shape[-1]}")
    return tok


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int | SamplingError]:
    """logits: [B, V]. Greedy rows share one arg-max; each sampled row draws with its own (seed, step)
    generator, so it is drawn alone; a row whose sampling fails gets its SamplingError instead of a token."""
    out: list[int | SamplingError] = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    if greedy:
        ids = torch.argmax(logits[greedy], dim=-1).tolist()
        for i, t in zip(greedy, ids):
            out[i] = t
    for i, p in enumerate(params):
        if not p.is_greedy:
            try:
                out[i] = sample_one(logits[i], p, steps[i])
            except Exception as e:  # whatever broke, it broke for this row alone
                out[i] = e if isinstance(e, SamplingError) else SamplingError(f"{type(e).__name__}: {e}")
    return out
