"""What a request asks of the sampler, and the log-probabilities it gets back: plain values, without torch, so the
gateway, which checks them at admission, starts without importing torch (engine/sampler.py does the sampling)."""
from __future__ import annotations

from dataclasses import dataclass

from .grammar import GrammarSpec

# below this a temperature is greedy (vLLM's _SAMPLING_EPS): 1/T would overflow float32 for T under ~3e-39,
# and logits / 5e-38 already overflow once a logit passes 17; far above that, the distribution is one-hot
# anyway for any logit gap float32 can resolve
GREEDY_BELOW = 1e-5


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
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), OpenAI's
    min_p: float = 0.0  # 0: off; else tokens less likely than min_p times the most likely one are dropped
    min_tokens: int = 0  # before this many tokens, end-of-sequence and stop tokens are not generated
    grammar: GrammarSpec | None = None  # structured output; its state lives with the request, not here

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    def is_plain_at(self, step: int) -> bool:
        """Greedy and nothing changes the logits at this step: the row takes the shared arg-max."""
        return (self.is_greedy and not self.has_penalties and not self.logit_bias and self.grammar is None
                and step >= self.min_tokens)


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probability of one token at one position, and the most likely tokens there (most likely first)."""
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]
