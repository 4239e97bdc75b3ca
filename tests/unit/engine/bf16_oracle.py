"""Teacher forcing for tokens served in bfloat16, against a float32 reference of the same bf16 weights.

The tolerance. bfloat16 keeps 8 significant bits: its step at 1.0 is EPS = 2**-7, at a logit of size s about
EPS * s. A served logit has been rounded to bf16 some 40 times on its way (4 layers of q/k/v, scores, softmax,
attention out, o_proj, residual, norm, gate/up, down; then the final norm and lm_head), and independent
roundings add up like sqrt(40) ~ 6.3 steps, so each logit may be off by STEPS = 8 steps of EPS * s. A served token
is the served arg-max: its reference logit can fall short of the reference maximum by the error of both logits,
2 * STEPS * EPS * s. With s the largest |reference logit| of the rows checked (~7.4 for the tiny and long presets)
that is ~0.93. Measured on the long preset, 20 prompts x 32 greedy tokens: the largest error of any logit 0.47
(8.2 steps, over all 512 of a row), the largest shortfall of a served token 0.17. Stale or foreign KV moves the
served token units away (check_rejects_foreign shows this tolerance still tells them apart).
"""
from __future__ import annotations

import torch

from tests.oracle import OracleMismatch

EPS = 2.0 ** -7
STEPS = 8


def bf16_tolerance(logits: torch.Tensor) -> float:
    return 2 * STEPS * EPS * float(logits.abs().max())


def check_bf16(reference, prompt: list[int], response: list[int], who: str = "float32 reference") -> float:
    """reference: a ModelRunner with the bf16 checkpoint's weights in float32. Returns the largest shortfall."""
    if not response:
        raise OracleMismatch("empty response")
    ids = list(prompt) + list(response)
    pages = list(range(-(-len(ids) // reference.page_size)))
    rows = reference.prefill(ids, pages, all_logits=True)[len(prompt) - 1:-1]  # row i predicts response[i]
    tol = bf16_tolerance(rows)
    short = rows.max(-1).values - rows[torch.arange(len(response)), torch.tensor(response)]
    j = int(short.argmax())
    if float(short[j]) > tol:
        raise OracleMismatch(f"{who}: response token {j} is {response[j]}, {float(short[j]):.4f} below the reference "
                             f"maximum (bf16 tolerance {tol:.4f}); prompt {len(prompt)} tokens")
    return float(short.max())
