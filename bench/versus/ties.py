"""Whether a greedy token-id mismatch between pdserve and vLLM is a float near tie or a defect.

Two correct float32 engines can still pick different greedy tokens: where the top two logits sit closer than
their rounding, a different GEMM order tips the arg-max the other way, and every later token follows from there.
A defect (stale or foreign KV, a wrong mask or position) moves logits far more than rounding does. So each mismatch
is re-computed at its first divergence by an independent reference, the checkpoint through transformers' own
forward in float64 (and in float32 for the margin either engine saw), on the prompt plus the output ids both
systems agreed on, and judged:

- near tie: both systems' tokens lie within TIE_ROUNDINGS float32 roundings of the float64 maximum, whichever
  it picks;
- not a tie: a defect: a system's token lies further below the float64 maximum than rounding can explain.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from . import protocol

# A token is "near" the float64 maximum when it lies within this many roundings of it, a rounding being the largest
# |float32 - float64| over the reference's own logits there: two correct float32 engines err by about one rounding
# each, in any direction. On the tiny checkpoint a rounding is ~1e-5, so the bound is ~1e-4: ten times under the
# 1e-3 by which the reference oracle already tells stale or foreign KV from float noise.
TIE_ROUNDINGS = 10.0
FLOAT32_EPS = 2.0 ** -23


@dataclass(slots=True, frozen=True)
class Judgement:
    position: int           # the output token where the two id lists first differ
    ours: int               # the token pdserve picked there
    theirs: int             # the token vLLM picked there
    margin32: float         # the float32 reference's top-2 margin there (top1 - top2)
    gap32: float            # float32 reference logit[ours] - logit[theirs]
    gap64: float            # float64 reference logit[ours] - logit[theirs]
    pick64: int             # the float64 reference's arg-max
    short_ours: float       # how far pdserve's token lies under the float64 maximum
    short_theirs: float     # how far vLLM's token lies under it
    rounding: float         # max |float32 - float64| over the reference's row: the rounding scale there
    bound: float            # how far under the float64 maximum a token may lie and still tie
    verdict: str

    def as_dict(self) -> dict:
        return asdict(self)


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    """The first output position where the lists differ (the shorter one's length if one is a prefix of the
    other), None where they are equal."""
    k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if k is None and len(ours) != len(theirs):
        k = min(len(ours), len(theirs))
    return k


def judge(row32: list[float], row64: list[float], ours: int, theirs: int, position: int,
          names: tuple[str, str] = ("pdserve", "vLLM"), roundings: float = TIE_ROUNDINGS) -> Judgement:
    """The verdict at a divergence from the reference's logits there (row32 and row64: one value per vocabulary
    id, the float32 and float64 forward of the same context)."""
    if len(row32) != len(row64) or not 0 <= ours < len(row64) or not 0 <= theirs < len(row64):
        raise ValueError(f"judge: rows of {len(row32)} and {len(row64)} logits, tokens {ours} and {theirs}")
    if not all(math.isfinite(x) for x in row64):
        raise ValueError("judge: the float64 reference's logits are not finite")
    top32 = sorted(row32, reverse=True)
    best64 = max(row64)
    pick64 = row64.index(best64)
    rounding = max(abs(a - b) for a, b in zip(row32, row64))
    # a floor of one float32 ulp of the largest logit: a row that rounded exactly still has that much freedom
    bound = roundings * max(rounding, FLOAT32_EPS * max(abs(x) for x in row64))
    short = {names[0]: best64 - row64[ours], names[1]: best64 - row64[theirs]}
    off = [f"{who}'s token {s:.2e} under the float64 maximum, {s / bound * roundings:.0f} roundings"
           for who, s in short.items() if s > bound]
    if ours == theirs:
        verdict = "not a mismatch: both picked the same token"
    elif off:
        verdict = "not a tie: a defect (" + "; ".join(off) + ")"
    else:
        side = names[0] if pick64 == ours else names[1] if pick64 == theirs else f"neither (token {pick64})"
        verdict = f"near tie, fp64 picks {side}'s" if pick64 in (ours, theirs) else f"near tie, fp64 picks {side}"
    return Judgement(position=position, ours=ours, theirs=theirs, margin32=top32[0] - top32[1],
                     gap32=row32[ours] - row32[theirs], gap64=row64[ours] - row64[theirs], pick64=pick64,
                     short_ours=short[names[0]], short_theirs=short[names[1]],
                     rounding=rounding, bound=bound, verdict=verdict)


def prompt_of(cell: str, r: int, tag: str, index: int, vocab_size: int) -> list[int]:
    """The prompt of request `index` of a cell's run (protocol.prompts draws them in order from one seed per cell,
    round and loop, so the first index + 1 of any run hold it)."""
    p, c = (int(x) for x in cell.split("x"))
    return protocol.prompts(protocol.Cell(p, c), r, tag, index + 1, vocab_size)[index]


class Reference:
    """The checkpoint through transformers' LlamaForCausalLM, in float32 and float64: no pdserve code, no vLLM."""

    def __init__(self, model_dir: str):
        import torch
        from transformers import LlamaForCausalLM

        self.torch = torch
        self.models = {dt: LlamaForCausalLM.from_pretrained(model_dir, dtype=dt).eval()
                       for dt in (torch.float32, torch.float64)}

    def rows(self, ids: list[int], dtype) -> "object":
        """Logits of every position of `ids`: [len(ids), V]."""
        with self.torch.inference_mode():
            return self.models[dtype](self.torch.tensor([ids])).logits[0]

    def next_logits(self, context: list[int]) -> tuple[list[float], list[float]]:
        """The float32 and float64 logits of the token after `context`."""
        return tuple(self.rows(context, dt)[-1].double().tolist() for dt in (self.torch.float32, self.torch.float64))

    def examine(self, prompt: list[int], ours: list[int], theirs: list[int],
                names: tuple[str, str] = ("pdserve", "vLLM")) -> Judgement | None:
        """The judgement at the first divergence of two greedy outputs of `prompt` (None where they agree)."""
        k = first_divergence(ours, theirs)
        if k is None:
            return None
        if k >= min(len(ours), len(theirs)):
            # a stream that ended early is no float question
            return Judgement(k, -1, -1, math.nan, math.nan, math.nan, -1, math.nan, math.nan, math.nan, math.nan,
                             f"not a tie: a defect ({len(ours)} and {len(theirs)} tokens)")
        row32, row64 = self.next_logits(prompt + ours[:k])
        return judge(row32, row64, ours[k], theirs[k], k, names)
