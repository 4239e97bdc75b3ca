"""Prefill worker: prompt forward pass into the local pool, then one-sided writes into a decode pool.

Data first, tags second: a tag is the writer's claim that the bytes before it are complete, so it
must never land before them. No gRPC here.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable
from dataclasses import dataclass

import torch

from ..common.config import pages_for
from ..common.faults import FAULTS
from ..common.metrics import FORWARD_SECONDS, GUARD_SECONDS
from ..engine.page_allocator import PageAllocator
from ..engine.runner import ModelRunner
from ..engine.sampler import SamplingParams, TokenLogprobs, logprobs, sample_one
from ..engine.tags import TAG_NBYTES, make_tags
from ..kvtransfer.engine import TransferEngine, coalesce

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Target:
    """Where one request's KV goes (decoded from a Destination)."""
    session: str
    data_base: int
    tag_base: int
    epoch: int
    leases: list[tuple[int, int]]  # (page, generation) in request order


@dataclass(slots=True)
class Progress:
    """Shared with the caller while the write runs: once posted, a failure may still land bytes later."""
    posted: bool = False


@dataclass(slots=True)
class Forward:
    first_token: int
    first_logprobs: TokenLogprobs | None
    prompt_logprobs: list[TokenLogprobs]  # one per prompt token from the second, when asked for


@dataclass(slots=True)
class Written:
    num_tokens: int
    num_pages: int
    checksums: list[int]
    nbytes: int
    seconds: float


class PrefillWorker:
    def __init__(self, runner: ModelRunner, transfer: TransferEngine, checksums: bool = True):
        self.runner = runner
        # the transfer checksum is the one guard an operator may switch off (--no-transfer-checksum)
        self.checksums = checksums
        self.pool = runner.pool
        self.transfer = transfer
        self.alloc = PageAllocator(self.pool.num_pages)
        transfer.register(self.pool.data_ptr, self.pool.data_nbytes)
        transfer.register(self.pool.tag_ptr, self.pool.tag_nbytes)

    def forward(self, token_ids: list[int], local_pages: list[int], sampling: SamplingParams,
                prompt_logprobs: int | None = None) -> Forward:
        """Step 0 goes through the same sampling as decode's later steps: one seed, the same tokens split or not."""
        with FORWARD_SECONDS.labels("prefill").time():
            logits = self.runner.prefill(token_ids, local_pages, all_logits=prompt_logprobs is not None)
        # logits: [T or 1, V]; row i predicts token i + 1
        first = sample_one(logits[-1], sampling, 0, token_ids, ())
        first_lp = logprobs(logits[-1:], [first], [sampling.logprobs])[0] if sampling.logprobs is not None else None
        prompt_lps = [] if prompt_logprobs is None else logprobs(logits[:-1], token_ids[1:],
                                                                  [prompt_logprobs] * (len(token_ids) - 1))
        return Forward(first, first_lp, prompt_lps)

    def write(self, owner: bytes, local_pages: list[int], num_tokens: int, target: Target,
              check_alive: Callable[[str], None] = lambda stage: None, progress: Progress | None = None) -> Written:
        """check_alive(stage) raises unless this writer's liveness lease still holds with a margin: a write
        posted after the broker presumed us dead could land on a page it has re-granted."""
        ps = self.pool.page_size
        n = pages_for(num_tokens, ps)
        if n > len(target.leases):
            raise ValueError(f"{num_tokens} tokens need {n} pages; the destination leases {len(target.leases)}")
        start = time.perf_counter()
        self.pool.zero_tail(local_pages[n - 1], num_tokens - (n - 1) * ps)
        with GUARD_SECONDS.labels("checksum").time():
            checksums = self.pool.checksums(local_pages[:n]) if self.checksums else [0] * n
        self.pool.tags[local_pages[:n]] = make_tags(owner, target.epoch, [g for _, g in target.leases[:n]],
                                                    num_tokens, ps, checksums)
        idx = list(range(n))
        if FAULTS.fire("prefill.short_transfer") is not None:
            idx = idx[:1]
        if (arg := FAULTS.fire("prefill.skip_page")) is not None:
            idx = [i for i in idx if i != int(arg or 0)]
        if (arg := FAULTS.fire("prefill.bit_flip")) is not None:
            k = min(int(arg or 0), n - 1)
            self.pool.kv[local_pages[k]].view(torch.uint8).view(-1)[123] ^= 0x10
        src = [local_pages[i] for i in idx]
        dst = [target.leases[i][0] for i in idx]
        check_alive("data")
        if progress is not None:
            progress.posted = True
        moved = self.transfer.write(target.session, coalesce(src, dst, self.pool.data_ptr, target.data_base,
                                                             self.pool.page_nbytes), stage="data")
        if (arg := FAULTS.fire("prefill.slow_transfer")) is not None:
            time.sleep(int(arg or 5000) / 1000)
        if FAULTS.fire("prefill.crash_mid_transfer") is not None:
            log.error("fault prefill.crash_mid_transfer: exiting between data and tag writes")
            os._exit(137)
        if FAULTS.fire("prefill.skip_tags") is None:
            check_alive("tags")
            moved += self.transfer.write(target.session, coalesce(src, dst, self.pool.tag_ptr, target.tag_base,
                                                                  TAG_NBYTES), stage="tags")
        return Written(num_tokens, n, checksums, moved, time.perf_counter() - start)
