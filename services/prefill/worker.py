"""Prefill worker: prompt forward pass into the local pool, then one-sided writes into a decode pool.

Data first, tags second: a tag is the writer's claim that the bytes before it are complete, so it
must never land before them. Each goes out in batch calls of at most the write unit, one after the
other (a call returns before the next is posted), every call behind its own liveness check: the
landing bound holds per call, from that call's post. No gRPC here.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable
from dataclasses import dataclass, field

import torch

from ..common.config import pages_for
from ..common.faults import FAULTS
from ..common.metrics import FORWARD_SECONDS, GUARD_SECONDS
from ..engine.grammar import GrammarState, fill
from ..engine.runner import Chunk, ModelRunner
from ..engine.sampler import SamplingParams, TokenLogprobs, accept, logprobs, sample_one
from ..engine.tags import TAG_NBYTES, make_tags
from ..kvtransfer.engine import DEFAULT_MAX_WRITE_BYTES, Run, TransferEngine, coalesce, split_calls
from .local_pages import LocalPages, Reservation

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
class Prompt:
    """One prompt's prefill, over one packed pass or several (chunks)."""
    token_ids: list[int]
    sampling: SamplingParams
    prompt_logprobs: int | None = None  # None: none asked for
    prompt_lps: list[TokenLogprobs] = field(default_factory=list)  # filled chunk by chunk
    chains: list[bytes] = field(default_factory=list)  # chain key of each full page under its scope; [] without
    cached_pages: int = 0  # the destination's: prompt pages already there, never sent
    grammar: GrammarState | None = None  # structured output: the first token is drawn under it, and fed to it
    # its local pages (local_pages.LocalPages), from when its first pass is planned
    reservation: Reservation | None = None

    @property
    def pages(self) -> list[int]:
        """Local pages in prompt order: the first `hit` are the prefix cache's (pinned, read-only), the rest its own."""
        return self.reservation.pages if self.reservation is not None else []

    @property
    def hit(self) -> int:
        return self.reservation.hit if self.reservation is not None else 0

    @property
    def copies(self) -> list[int]:
        """Own pages taking the bytes of cached pages cached_pages..hit-1."""
        return self.reservation.copies if self.reservation is not None else []

    @property
    def own_pages(self) -> list[int]:
        """The local pages this prompt alone holds (freed or cached when it is done); the rest are pinned."""
        return self.reservation.own if self.reservation is not None else []


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
    # the CRC-32C of the prompt's pages by index as this write computed them ({} with checksums off): what a page
    # entering the prefix cache is recorded with
    page_crcs: dict[int, int] = field(default_factory=dict)


class PrefillWorker:
    def __init__(self, runner: ModelRunner, transfer: TransferEngine, checksums: bool = True,
                 max_write_bytes: int = DEFAULT_MAX_WRITE_BYTES, prefix_cache: bool = True,
                 prefix_cache_pages: int | None = None):
        """prefix_cache_pages: at most this many pages in the local prefix cache (None: as the pool allows)."""
        self.runner = runner
        # the transfer checksum is the one guard an operator may switch off (--no-transfer-checksum)
        self.checksums = checksums
        self.pool = runner.pool
        if self.pool.page_nbytes > max_write_bytes:
            raise ValueError(f"one KV page of {self.pool.page_nbytes} bytes does not fit in the write unit of "
                             f"{max_write_bytes} bytes")
        self.max_write_bytes = max_write_bytes
        self.transfer = transfer
        # the worker only reads a prompt's reservation: the servicer and the queue take and give back its pages
        self.local = LocalPages(self.pool.num_pages, self.pool.checksums, prefix_cache_pages if prefix_cache else 0)
        transfer.register(self.pool.data_ptr, self.pool.data_nbytes)
        transfer.register(self.pool.tag_ptr, self.pool.tag_nbytes)

    @property
    def alloc(self):
        """The local pool's allocator (its counts); LocalPages alone changes it."""
        return self.local.alloc

    @property
    def cache(self):
        """The local prefix cache (its counts and lookups); LocalPages alone changes it."""
        return self.local.cache

    def forward(self, chunks: list[tuple[Prompt, int, int]]) -> list[Forward | Exception | None]:
        """One packed pass over tokens [start, start + n) of each prompt. For each: its Forward once its last chunk
        ran, None before, or the exception its own sampling raised (the rest of the pass is served). Step 0 goes
        through the same sampling as decode's later steps: one seed, the same tokens split, packed or not."""
        if (arg := FAULTS.fire("prefill.slow_forward")) is not None:
            time.sleep(int(arg or 1000) / 1000)
        with FORWARD_SECONDS.labels("prefill").time():
            logits = self.runner.prefill_batch([Chunk(p.token_ids[s:s + n], s, p.pages, p.prompt_logprobs is not None)
                                                for p, s, n in chunks])
        eos = self.runner.config.eos_token_ids
        return [self._finish_chunk(p, s, n, rows, eos) for (p, s, n), rows in zip(chunks, logits)]

    @staticmethod
    def _finish_chunk(p: Prompt, start: int, n: int, rows: torch.Tensor, eos_ids=()) -> Forward | Exception | None:
        # rows: [n or 1, V]; row i predicts token start + i + 1
        ids = p.token_ids
        upto = min(start + n, len(ids) - 1)  # the rows that predict prompt tokens
        if p.prompt_logprobs is not None and upto > start:
            p.prompt_lps += logprobs(rows[:upto - start], ids[start + 1:upto + 1], [p.prompt_logprobs] * (upto - start))
        if start + n < len(ids):
            return None
        try:
            mask = fill([p.grammar], rows.shape[-1])[0] if p.grammar is not None else None
            first = sample_one(rows[-1], p.sampling, 0, ids, (), mask, eos_ids)
            if p.grammar is not None and (err := accept(p.grammar, first)) is not None:
                raise err
        except Exception as e:  # noqa: BLE001  (this prompt's own failure)
            return e
        lp = logprobs(rows[-1:], [first], [p.sampling.logprobs])[0] if p.sampling.logprobs is not None else None
        return Forward(first, lp, p.prompt_lps)

    def send(self, owner: bytes, prompt: Prompt, target: Target, check_alive: Callable[[str], None] = lambda s: None,
             progress: Progress | None = None) -> Written:
        """Writes the prompt's pages from the destination's cached_pages on into target.leases[0..]. A page of the
        local prefix cache among them is copied into one of the prompt's own pages first: its tag row is about to
        hold this request's tag, and another write may be posting the same cached page with its own tag at this
        moment (a copy also keeps every cached page out of every write, so none ever waits out a failed write's
        landing bound)."""
        ps = self.pool.page_size
        res = prompt.reservation  # read only: LocalPages gave it and alone ends it
        if res is None:
            raise ValueError("the prompt holds no local pages: its forward pass never ran")
        n, c, h = len(prompt.token_ids), prompt.cached_pages, res.hit
        if len(res.copies) != max(0, h - c):
            raise ValueError(f"{len(res.copies)} private pages for cached prompt pages {c}..{h - 1}")
        if res.copies:
            self.pool.kv[res.copies] = self.pool.kv[res.pages[c:h]]
            if self.pool.kv.is_cuda:  # the transport reads the bytes behind torch's back: the copy must be done
                torch.cuda.current_stream(self.pool.kv.device).synchronize()
        sources = res.copies + res.pages[max(c, h):]
        written = self.write(owner, sources, n - c * ps, target, check_alive, progress, first_index=c,
                             chains=prompt.chains[c:n // ps])
        if self.checksums:
            written.page_crcs = dict(zip(range(c, c + len(written.checksums)), written.checksums))
        return written

    def write(self, owner: bytes, local_pages: list[int], num_tokens: int, target: Target,
              check_alive: Callable[[str], None] = lambda stage: None, progress: Progress | None = None,
              first_index: int = 0, chains: list[bytes] = ()) -> Written:
        """Writes num_tokens tokens held in local_pages as the request's pages first_index.. (chains: the chain
        keys of the first len(chains) of them, full pages under a prefix scope). check_alive(stage) raises unless
        this writer's liveness lease still holds with a margin: a write posted after the broker presumed us dead
        could land on a page it has re-granted."""
        ps = self.pool.page_size
        n = pages_for(num_tokens, ps)
        if n > len(target.leases):
            raise ValueError(f"{num_tokens} tokens need {n} pages; the destination leases {len(target.leases)}")
        start = time.perf_counter()
        self.pool.zero_tail(local_pages[n - 1], num_tokens - (n - 1) * ps)
        with GUARD_SECONDS.labels("checksum").time():
            checksums = self.pool.checksums(local_pages[:n]) if self.checksums else [0] * n
        self.pool.tags[local_pages[:n]] = make_tags(owner, target.epoch, [g for _, g in target.leases[:n]],
                                                    num_tokens, ps, checksums, first_index, list(chains))
        idx = list(range(n))
        if FAULTS.fire("prefill.short_transfer", owner) is not None:
            idx = idx[:1]
        if (arg := FAULTS.fire("prefill.skip_page", owner)) is not None:
            idx = [i for i in idx if i != int(arg or 0)]
        if (arg := FAULTS.fire("prefill.bit_flip", owner)) is not None:
            k = min(int(arg or 0), n - 1)
            self.pool.kv[local_pages[k]].view(torch.uint8).view(-1)[123] ^= 0x10
        src = [local_pages[i] for i in idx]
        dst = [target.leases[i][0] for i in idx]
        data = coalesce(src, dst, self.pool.data_ptr, target.data_base, self.pool.page_nbytes)
        moved = self._post(target.session, data, self.pool.page_nbytes, "data", check_alive, progress, owner)
        if (arg := FAULTS.fire("prefill.slow_transfer", owner)) is not None:
            time.sleep(int(arg or 5000) / 1000)
        if FAULTS.fire("prefill.crash_mid_transfer", owner) is not None:
            log.error("fault prefill.crash_mid_transfer: exiting between data and tag writes")
            os._exit(137)
        if FAULTS.fire("prefill.skip_tags", owner) is None:
            tags = coalesce(src, dst, self.pool.tag_ptr, target.tag_base, TAG_NBYTES)
            moved += self._post(target.session, tags, TAG_NBYTES, "tags", check_alive, progress, owner)
        return Written(num_tokens, n, checksums, moved, time.perf_counter() - start)

    def _post(self, session: str, runs: list[Run], stride: int, stage: str, check_alive: Callable[[str], None],
              progress: Progress | None, owner: bytes) -> int:
        """One batch call per write unit, in order. The liveness check comes before every call, not once per
        write: a write of many calls outlasts the landing bound, but each call lands within it from its own post,
        and that post is inside the liveness lease."""
        moved = 0
        for batch in split_calls(runs, self.max_write_bytes, stride):
            check_alive(stage)
            if progress is not None:
                progress.posted = True
            moved += self.transfer.write(session, batch, stage=stage, owner=owner)
        return moved
