"""A decode request while it joins and runs: its leases and the ownership words its pages' tags must carry, its
sampling, and the tokens generated so far."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import torch

from ..common.errors import PdError
from ..engine.grammar import GrammarState
from ..engine.sampler import SamplingParams
from ..engine.tags import expected_tags
from .sweep import PromptRecord


@dataclass(eq=False)
class Sequence:
    owner: bytes
    epoch: int
    leases: list[tuple[int, int]]
    expected: torch.Tensor          # [num_leases, 5] ownership words each page's tag must carry
    num_prompt_tokens: int
    sampling: SamplingParams
    eos_token_ids: frozenset[int]   # every end-of-sequence id of the checkpoint (Llama 3.x has three)
    generated: list[int]            # generated[0] is prefill's first token
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    pages: list[int] = field(init=False)  # physical pages in request order, read every step
    page_ids: torch.Tensor = field(init=False)  # the same, as a tensor for the per-step check
    cancelled: bool = False
    err: PdError | None = None  # why it was cancelled, when the request must end with an error
    done: bool = False
    prompt: PromptRecord | None = None  # prompt pages and their verified checksums, for the sweep
    # only when repetition_penalty counts them; a tensor, so a long prompt is not converted again at every step
    prompt_token_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    # pages on demand: the pages the whole request may come to use (prompt + max_tokens); leases holds fewer until
    # growth (growth.py) has leased the rest. 0: every page was leased up front.
    max_pages: int = 0
    admitted: int = 0  # admission order: the policy preempts the youngest (largest) first
    handed_back: int = 0  # times the gateway resubmitted it before: the policy preempts the fewest first
    # structured output: the grammar's state after every token generated so far (None: unconstrained)
    grammar: GrammarState | None = None
    revoked: bool = False  # decode learnt that the broker ended its leases (counted once: first_revocation)

    @property
    def position(self) -> int:
        """Position of the token fed in the next step (the last generated one)."""
        return self.num_prompt_tokens + len(self.generated) - 1

    def __post_init__(self) -> None:
        self.pages = [p for p, _ in self.leases]
        self.page_ids = torch.tensor(self.pages, dtype=torch.int64)

    def has_page_for_next_step(self, page_size: int) -> bool:
        """Whether the page the next step writes (that of `position`) is leased: a step never writes a page the
        broker has not leased to this owner."""
        return self.position // page_size < len(self.leases)

    def grow(self, leases: list[tuple[int, int]]) -> None:
        """Appends growth leases (from the broker's Extend reply) after the ones held: pages, ids and the
        ownership words the per-step tag check expects, at the page indices that follow."""
        first = len(self.leases)
        self.leases = [*self.leases, *leases]
        self.pages = [*self.pages, *(p for p, _ in leases)]
        self.page_ids = torch.tensor(self.pages, dtype=torch.int64)
        words = expected_tags(self.owner, self.epoch, leases)
        words[:, -1] += first  # page_index is the position in the request, not in this batch of leases
        self.expected = torch.cat([self.expected, words])

    def first_revocation(self) -> bool:
        """True the first time decode learns the broker ended this request's leases (its notice, a re-check, a
        refused Extend, in any order): the one time the lease violation is counted."""
        first, self.revoked = not self.revoked, True
        return first

    def is_stopped(self) -> bool:
        """Ended by its last token: end-of-sequence (unless ignore_eos), one of its stop tokens, or the one that
        completed its grammar's output."""
        if self.grammar is not None and self.grammar.is_done:
            return True
        last = self.generated[-1]
        if not self.sampling.ignore_eos and last in self.eos_token_ids:
            return True
        return last in self.sampling.stop_token_ids

    def is_finished(self) -> bool:
        return self.is_stopped() or len(self.generated) >= self.sampling.max_tokens


def raise_if_ended(seq: Sequence) -> None:
    """A sequence marked while it was joining ends before any (further) token is sent."""
    if seq.err is not None:
        raise seq.err
    if seq.cancelled:
        raise PdError(grpc.StatusCode.CANCELLED, "RELEASED", "the request was released before decoding began")
