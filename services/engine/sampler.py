"""Sampling with a per-request seed: penalties, temperature, top-k, top-p; and the log-probabilities clients ask for.

The draw for step i of a request depends only on (seed, i), and step 0 (prefill) runs through the same function
as every later step (decode), so a request gives the same tokens on one machine or split across two.

Processing follows vLLM: repetition penalty (over prompt and output), then frequency and presence penalties (over
output only), then logit_bias, min_tokens (end-of-sequence and stop tokens forbidden before it), the grammar's mask
(structured output, engine/grammar.py), then greedy arg-max or temperature, min_p, top-k, top-p and the draw.
Log-probabilities are always of the model's raw logits, before any of that. A row with none of these options
runs exactly as before: greedy ones share one arg-max over the logits as they came.

Numerically safe for every admitted value (temperature finite and >= 0, top_p in (0, 1]): a temperature
below GREEDY_BELOW is greedy, the logits are shifted by their maximum before they are scaled, so nothing
can overflow to +inf, and probabilities that are still not finite (the model's own logits were) raise
SamplingError for that row alone: `sample` returns it in the row's place and the rest of the batch is drawn.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .grammar import GrammarState, apply_mask
from .sampling_params import GREEDY_BELOW, SamplingParams, TokenLogprobs  # noqa: F401 (the sampler's own types)

_FMAX = torch.finfo(torch.float32).max


class SamplingError(Exception):
    """One row's sampling failed; the caller ends that sequence alone."""


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


def _shape(x: torch.Tensor, params: list[SamplingParams], steps: list[int], eos_ids: Sequence[int],
           mask: torch.Tensor | None) -> None:
    """x: [R, V] float logits, already penalised, changed in place: logit_bias, min_tokens, then the grammar's
    mask (mask: [R, W] int32 bitmask, or None when no row has a grammar; rows without one are all ones)."""
    for r, (p, step) in enumerate(zip(params, steps)):
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.int64, device=x.device)
            x[r, ids] += torch.tensor([b for _, b in p.logit_bias], dtype=x.dtype, device=x.device)
        if step < p.min_tokens:
            blocked = [t for t in (*eos_ids, *p.stop_token_ids) if 0 <= t < x.shape[-1]]
            if blocked:
                x[r, blocked] = float("-inf")
    if mask is not None:
        apply_mask(x, mask)


def _probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    # logits: [V] -> probabilities [V]; (x - max) <= 0, so x / T can only underflow towards -inf (weight 0),
    # never overflow: the arg-max keeps weight exp(0) = 1 and the sum is >= 1
    x = logits.float().cpu()
    x = (x - x.max()) / params.temperature
    if params.min_p > 0:
        # relative to the most likely token, whose scaled logit is 0: p_t / p_max = exp(x_t)
        x = x.masked_fill(x < torch.log(torch.tensor(params.min_p)), float("-inf"))
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


def _no_token_left(x: torch.Tensor) -> SamplingError:
    return SamplingError("no token is allowed at this step (the grammar, min_tokens and logit_bias together "
                         f"forbid all {x.shape[-1]})")


def _choose(x: torch.Tensor, params: SamplingParams, step: int) -> int:
    # x: [V] logits, already penalised
    if params.is_greedy:
        tok = int(torch.argmax(x))
        if x[tok] == float("-inf"):
            raise _no_token_left(x)
        return tok
    if not bool((x > float("-inf")).any()):
        raise _no_token_left(x)
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
               output: Sequence[int] = (), mask: torch.Tensor | None = None, eos_ids: Sequence[int] = ()) -> int:
    """logits: [V]; output: the tokens generated before this step (step 0: none); mask: [W] int32, the grammar's
    bitmask of this step (grammar.Grammars.fill), or None; eos_ids: what min_tokens holds back besides stop tokens."""
    x = logits.float()
    if params.has_penalties:
        x = apply_penalties(x[None], [params], [prompt], [output])[0]
    if mask is not None or params.logit_bias or step < params.min_tokens:
        x = x.clone() if x.data_ptr() == logits.data_ptr() else x  # the caller's logits stay the model's
        _shape(x[None], [params], [step], eos_ids, None if mask is None else mask[None])
    return _choose(x, params, step)


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int],
           prompts: Sequence[Sequence[int] | torch.Tensor] | None = None,
           outputs: Sequence[Sequence[int]] | None = None, masks: dict[int, torch.Tensor] | None = None,
           eos_ids: Sequence[int] = ()) -> list[int | SamplingError]:
    """logits: [B, V]. Greedy rows without options share one arg-max; penalties are applied to all penalised
    rows at once; each sampled row draws with its own (seed, step) generator, so it is drawn alone; a row whose
    sampling fails gets its SamplingError instead of a token. prompts/outputs are read for penalised rows only.
    masks: row -> its grammar's [W] int32 bitmask for this step (constrained rows only); the logits themselves
    are never changed (log-probabilities stay those of the model). eos_ids: what min_tokens holds back."""
    masks = masks or {}
    out: list[int | SamplingError] = [0] * len(params)
    plain = [i for i, p in enumerate(params) if p.is_plain_at(steps[i]) and i not in masks]
    if plain:
        # one arg-max over the logits as they came, whatever the other rows need (dropping theirs is cheaper than
        # gathering the plain rows first): a plain row's token is the same op on the same values in every batch
        best = torch.argmax(logits, dim=-1).tolist()
        for i in plain:
            out[i] = best[i]
    if len(plain) == len(params):
        return out
    taken = set(plain)
    rest = [i for i in range(len(params)) if i not in taken]
    x = logits[rest].float()
    pen = [j for j, i in enumerate(rest) if params[i].has_penalties]
    if pen:
        if prompts is None or outputs is None:
            raise ValueError(f"{len(pen)} rows have penalties but no prompt and output tokens were given")
        x[pen] = apply_penalties(x[pen], [params[rest[j]] for j in pen], [prompts[rest[j]] for j in pen],
                                 [outputs[rest[j]] for j in pen])
    shaped = [j for j, i in enumerate(rest) if i in masks or params[i].logit_bias or steps[i] < params[i].min_tokens]
    if shaped:
        mask = None
        if masks:
            words = next(iter(masks.values())).shape[-1]
            mask = torch.stack([masks[rest[j]] if rest[j] in masks else torch.full((words,), -1, dtype=torch.int32)
                                for j in shaped])
        whole = len(shaped) == len(rest)  # the usual case: only constrained rows got here
        y = x if whole else x[shaped]
        _shape(y, [params[rest[j]] for j in shaped], [steps[rest[j]] for j in shaped], eos_ids, mask)
        if not whole:
            x[shaped] = y
    greedy = [j for j, i in enumerate(rest) if params[i].is_greedy]  # one arg-max for them all
    if greedy:
        picked = torch.argmax(x if len(greedy) == len(rest) else x[greedy], dim=-1).tolist()
        for j, t in zip(greedy, picked):
            out[rest[j]] = t
        for j in set(greedy).intersection(shaped):  # only a shaped row can have had every token taken away
            if x[j, out[rest[j]]] == float("-inf"):
                out[rest[j]] = _no_token_left(x[j])
    for j, i in enumerate(rest):
        if params[i].is_greedy:
            continue
        try:
            out[i] = _choose(x[j], params[i], steps[i])
        except Exception as e:  # whatever broke, it broke for this row alone
            out[i] = e if isinstance(e, SamplingError) else SamplingError(f"{type(e).__name__}: {e}")
    return out


def accept(state: GrammarState, token: int) -> SamplingError | None:
    """Feeds a sampled token to its grammar; a token it refuses (it never should: the mask allowed it) is the row's
    SamplingError, so nothing that breaks the grammar is ever sent."""
    why = state.accept(token)
    return None if why is None else SamplingError(f"the grammar refused sampled token {token}: {why}")


def advance(states: dict[int, GrammarState], tokens: list[int | SamplingError]) -> None:
    """accept() for each constrained row of a decode step: a refused token becomes that row's SamplingError."""
    for i, state in states.items():
        if not isinstance(tokens[i], SamplingError) and (err := accept(state, tokens[i])) is not None:
            tokens[i] = err


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
