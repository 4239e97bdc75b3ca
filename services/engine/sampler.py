"""Sampling with a per-request seed: penalties, temperature, top-k, top-p; and the log-probabilities clients ask for.

The draw for step i of a request depends only on (seed, i), and step 0 (prefill) runs through the same function
as every later step (decode), so a request gives the same tokens on one machine or split across two.

Processing follows vLLM: repetition penalty (over prompt and output), then frequency and presence penalties (over
output only), then greedy arg-max or temperature, top-k, top-p and the draw. Log-probabilities are always of the
model's raw logits, before any of that.

Numerically safe for every admitted value (temperature finite and >= 0, top_p in (0, 1]): a temperature
below GREEDY_BELOW is greedy, the logits are shifted by their maximum before they are scaled, so nothing
can overflow to +inf, and probabilities that are still not finite (the model's own logits were) raise
SamplingError for that row alone: `sample` returns it in the row's place and the rest of the batch is drawn.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

# below this a temperature is greedy (vLLM's _SAMPLING_EPS): 1/T would overflow float32 for T under ~3e-39,
# and logits / 5e-38 already overflow once a logit passes 17; far above that, the distribution is one-hot
# anyway for any logit gap float32 can resolve
GREEDY_BELOW = 1e-5
_FMAX = torch.finfo(torch.float32).max


class SamplingError(Exception):
    """One row's sampling failed; the caller ends that sequence alone."""


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 16
    ignore_eos: bool = False
    top_k: int = 0  # 0: no limit
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: none asked for; n: the token's own and the n most likely

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probability of one token at one position, and the most likely tokens there (most likely first)."""
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


def _step_generator(seed: int, step: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) & ((1 << 63) - 1))
    return g


def _flat(rows: Sequence[Sequence[int] | torch.Tensor], vocab: int, device) -> torch.Tensor:
    """The rows' token ids as indices into the flattened [R * V] logits (row r's token t at r * V + t). A row may
    be an int64 tensor already (decode keeps a long prompt as one, rather than converting it at every step)."""
    parts = [torch.as_tensor(ids, dtype=torch.int64) + r * vocab for r, ids in enumerate(rows) if len(ids)]
    return torch.cat(parts).to(device) if parts else torch.zeros(0, dtype=torch.int64, device=device)


def apply_penalties(x: torch.Tensor, params: list[SamplingParams], prompts: Sequence[Sequence[int] | torch.Tensor],
                    outputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """x: [R, V] logits of penalised rows; returns them penalised (a new tensor). Only the positions of tokens
    that occurred are touched, each once (no atomics, so the result is the same on every run and device). An
    extreme penalty saturates at the float32 range rather than overflowing to inf (NaN stays NaN: caught later)."""
    num_rows, vocab = x.shape
    dev = x.device
    x = x.float().clone().view(-1)
    out = _flat(outputs, vocab, dev)
    if any(p.repetition_penalty != 1.0 for p in params):
        # CTRL / transformers' RepetitionPenaltyLogitsProcessor: every token seen in prompt or output, once
        seen = torch.unique(torch.cat([out, _flat([pr if p.repetition_penalty != 1.0 else ()
                                                   for p, pr in zip(params, prompts)], vocab, dev)]))
        rep = torch.tensor([p.repetition_penalty for p in params], device=dev)[seen // vocab]
        v = x[seen]
        x[seen] = torch.where(v < 0, v * rep, v / rep).clamp(-_FMAX, _FMAX)
    if out.numel() and any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        # OpenAI: minus frequency_penalty per occurrence in the output, minus presence_penalty once
        ids, counts = torch.unique(out, return_counts=True)
        row = ids // vocab
        freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[row]
        pres = torch.tensor([p.presence_penalty for p in params], device=dev)[row]
        x[ids] = (x[ids] - (freq * counts + pres)).clamp(-_FMAX, _FMAX)
    return x.view(num_rows, vocab)


def _probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    # logits: [V] -> probabilities [V]; (x - max) <= 0, so x / T can only underflow towards -inf (weight 0),
    # never overflow: the arg-max keeps weight exp(0) = 1 and the sum is >= 1
    x = logits.float().cpu()
    x = (x - x.max()) / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))  # ties with the k-th stay, as in transformers' TopKLogitsWarper
    probs = torch.softmax(x, dim=-1)
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


def _choose(x: torch.Tensor, params: SamplingParams, step: int) -> int:
    # x: [V] logits, already penalised
    if params.is_greedy:
        return int(torch.argmax(x))
    probs = _probs(x, params)
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
        raise SamplingError(f"logits give no valid distribution (max logit {float(x.max())}, temperature "
                            f"{params.temperature}, top_p {params.top_p}): the model's logits are not finite")
    try:
        tok = _draw(probs, params, step)
    except RuntimeError as e:
        raise SamplingError(f"drawing a token failed: {e}") from e
    if not 0 <= tok < x.shape[-1]:
        raise SamplingError(f"drew token {tok} outside the vocabulary of {x.shape[-1]}")
    return tok


def sample_one(logits: torch.Tensor, params: SamplingParams, step: int, prompt: Sequence[int] = (),
               output: Sequence[int] = ()) -> int:
    """logits: [V]; output: the tokens generated before this step (step 0: none)."""
    x = logits.float()
    if params.has_penalties:
        x = apply_penalties(x[None], [params], [prompt], [output])[0]
    return _choose(x, params, step)


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int],
           prompts: Sequence[Sequence[int] | torch.Tensor] | None = None,
           outputs: Sequence[Sequence[int]] | None = None) -> list[int | SamplingError]:
    """logits: [B, V]. Greedy rows without penalties share one arg-max; penalties are applied to all penalised
    rows at once; each sampled row draws with its own (seed, step) generator, so it is drawn alone; a row whose
    sampling fails gets its SamplingError instead of a token. prompts/outputs are read for penalised rows only."""
    out: list[int | SamplingError] = [0] * len(params)
    plain = [i for i, p in enumerate(params) if p.is_greedy and not p.has_penalties]
    if plain:
        # the common batch (all greedy, no options) takes its arg-max without copying the logits
        for i, t in zip(plain, torch.argmax(logits if len(plain) == len(params) else logits[plain], dim=-1).tolist()):
            out[i] = t
    rest = [i for i, p in enumerate(params) if not (p.is_greedy and not p.has_penalties)]
    if not rest:
        return out
    x = logits[rest].float()
    pen = [j for j, i in enumerate(rest) if params[i].has_penalties]
    if pen:
        if prompts is None or outputs is None:
            raise ValueError(f"{len(pen)} rows have penalties but no prompt and output tokens were given")
        x[pen] = apply_penalties(x[pen], [params[rest[j]] for j in pen], [prompts[rest[j]] for j in pen],
                                 [outputs[rest[j]] for j in pen])
    greedy = [j for j, i in enumerate(rest) if params[i].is_greedy]  # penalised: one arg-max for them all
    for j, t in zip(greedy, torch.argmax(x[greedy], dim=-1).tolist() if greedy else []):
        out[rest[j]] = t
    for j, i in enumerate(rest):
        if params[i].is_greedy:
            continue
        try:
            out[i] = _choose(x[j], params[i], steps[i])
        except Exception as e:  # whatever broke, it broke for this row alone
            out[i] = e if isinstance(e, SamplingError) else SamplingError(f"{type(e).__name__}: {e}")
    return out


def logprobs(logits: torch.Tensor, tokens: list[int], num_top: list[int], chunk: int = 512) -> list[TokenLogprobs]:
    """logits: [R, V] raw model logits; row r's log-softmax at tokens[r], with its num_top[r] most likely.
    In chunks of rows: a long prompt's [T, V] log-softmax in one piece would double prefill's peak memory."""
    out: list[TokenLogprobs] = []
    for s in range(0, logits.shape[0], chunk):
        lp = torch.log_softmax(logits[s:s + chunk].float(), dim=-1)
        tops = num_top[s:s + chunk]
        chosen = lp.gather(1, torch.tensor(tokens[s:s + chunk], device=lp.device)[:, None])[:, 0].tolist()
        k = min(max(tops), lp.shape[-1])
        vals, ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        out += [TokenLogprobs(c, i[:n], v[:n]) for c, i, v, n in zip(chosen, ids.tolist(), vals.tolist(), tops)]
    return out
