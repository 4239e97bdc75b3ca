"""Prefill's queue: bounded, first in first out, packed into forward passes of at most max_batch_tokens tokens.

A prompt longer than a pass runs in chunks; while a prompt that fits in half a pass waits, each of its chunks takes
at most half a pass, so short prompts behind it get the other half of every pass instead of waiting for all of it.
Work is dropped only before its first pass (its caller left, or its deadline passed): once a prompt's KV is being
computed it runs to its end, since the write that follows must never stop half-way. Local pages are taken when a
prompt's first pass is planned, so a queued prompt holds none; a head that does not fit waits, nothing overtakes it.
A prompt whose prefix is in the local prefix cache starts its first pass after it, over the cached pages' KV; the
cache gives back unused pages before a head waits for pages. A prompt whose next uncached prefix page another prompt
is computing now (conversations that start together over one system prompt) waits until that prompt's pages enter
the cache, or fail to, and lets the prompts behind it pass meanwhile: the prefix is computed once, not once each.
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Callable

import grpc

from ..common.config import pages_for
from ..common.deadline import deadline_exceeded
from ..common.errors import PdError
from ..common.metrics import (OVERLOAD_REJECTIONS, PREFILL_BATCH, PREFILL_DROPPED,
                              PREFILL_GONE_AT_START, PREFILL_QUEUE, PREFILL_SEQUENCES, PREFIX_WAITS, QUEUE_SECONDS)
from .local_pages import LocalPages
from .worker import Forward, Prompt

log = logging.getLogger(__name__)

# forward(chunks): one pass over tokens [start, start + n) of each prompt; per chunk a Forward once the prompt is
# done, None before, or the exception that failed that prompt alone
ForwardFn = Callable[[list[tuple[Prompt, int, int]]], list[Forward | Exception | None]]


@dataclass(slots=True, eq=False)
class Queued:
    prompt: Prompt
    num_pages: int
    deadline: float | None
    future: asyncio.Future
    left: bool = False  # the caller's RPC was cancelled
    done: int = 0  # tokens whose KV is in the pool
    started: bool = False  # planned into a pass: it holds pages and is no longer dropped
    skipped: int = 0  # tokens whose KV the prefix cache had: the first pass starts after them
    waited: bool = False  # its start waited for another prompt computing its prefix (counted once)
    queued_at: float = field(default_factory=time.monotonic)

    def drop_reason(self, now: float) -> str | None:
        # first: gRPC cancels a call whose deadline passed, and that caller left because of its deadline
        if self.deadline is not None and now >= self.deadline:
            return "deadline"
        if self.left:
            return "cancelled"
        return None


class Batcher:
    def __init__(self, forward: ForwardFn, local: LocalPages, page_size: int, max_batch_tokens: int = 2048,
                 queue_limit: int = 256):
        """local: the pages a prompt is given when it starts (the servicer gives them back)."""
        if max_batch_tokens < 1 or queue_limit < 1:
            raise ValueError(f"max_batch_tokens ({max_batch_tokens}) and queue_limit ({queue_limit}) must be >= 1")
        self.forward = forward
        self.local = local
        self.page_size = page_size
        self.max_batch_tokens = max_batch_tokens
        self.queue_limit = queue_limit
        self._queue: deque[Queued] = deque()
        # chain key -> the prompt computing that prefix page, from its start until its pages are cached or freed
        self._computing: dict[bytes, Prompt] = {}
        self._wake = asyncio.Event()  # pages were freed or a caller left
        self._task: asyncio.Task | None = None
        self._tokens_per_s: float | None = None  # of recent passes (a moving average): the refusals' retry delay
        # where passes run (None: the loop's default executor); one thread, so torch's OpenMP threads form one team
        self.executor: Executor | None = None
        self.num_waiting = 0  # queued prompts whose first pass has not started (read by the metrics thread)
        OVERLOAD_REJECTIONS.labels("prefill", "queue_full")  # exported at 0 from start-up

    @property
    def alloc(self):
        """The local pool's allocator (its counts); LocalPages alone changes it."""
        return self.local.alloc

    def retry_after_s(self) -> float:
        """When the prompts queued now should be done, at the recent passes' token rate (1 s before any pass)."""
        if not self._tokens_per_s:
            return 1.0
        left = sum(len(item.prompt.token_ids) - item.done for item in self._queue)
        return min(60.0, max(0.05, left / self._tokens_per_s))

    def wake(self) -> None:
        self._wake.set()

    def submit(self, prompt: Prompt, deadline: float | None = None) -> Queued:
        """Queues the prompt, or refuses it when the queue is full: before any lease call is made for it."""
        if len(self._queue) >= self.queue_limit:
            OVERLOAD_REJECTIONS.labels("prefill", "queue_full").inc()
            raise PdError(grpc.StatusCode.RESOURCE_EXHAUSTED, "PREFILL_QUEUE_FULL",
                          f"the prefill queue holds {len(self._queue)} prompts, its limit (--prefill-queue-limit "
                          f"{self.queue_limit}); retry later or elsewhere", self.retry_after_s())
        item = Queued(prompt, pages_for(len(prompt.token_ids), self.page_size), deadline,
                      asyncio.get_running_loop().create_future())
        self._queue.append(item)
        self._count_waiting()
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop())
        return item

    def leave(self, item: Queued) -> None:
        """The caller left: the prompt is dropped if its first pass has not started."""
        item.left = True
        self._wake.set()

    def computed(self, prompt: Prompt) -> None:
        """The prompt's pages were cached or freed (worker.send succeeded or not): a prompt that waits for its prefix
        starts now, from the cache or computing it itself."""
        for key in prompt.chains:
            if self._computing.get(key) is prompt:
                del self._computing[key]
        self._wake.set()

    async def result(self, item: Queued) -> Forward:
        """The prompt's Forward. Its local pages are in prompt.pages from its first pass on, for the caller to free
        once it no longer needs them (also when this raises)."""
        try:
            return await asyncio.shield(item.future)
        except asyncio.CancelledError:
            self.leave(item)
            item.future.add_done_callback(lambda f: f.exception())  # nobody else will read it
            if item.started:  # its pages are in a pass: the caller may free them only once it has ended
                await asyncio.wait([item.future])
            raise

    async def _loop(self) -> None:
        try:
            while self._queue:
                self._wake.clear()
                batch = self._plan(time.monotonic())
                self._count_waiting()
                if not batch:
                    if self._queue:  # the head waits for local pages, or a deadline
                        await self._wait()
                    continue
                try:
                    began = time.monotonic()
                    pass_ = functools.partial(contextvars.copy_context().run, self._pass, batch)  # as asyncio.to_thread
                    results = await asyncio.get_running_loop().run_in_executor(self.executor, pass_)
                    rate = sum(n for _, _, n in batch) / max(1e-6, time.monotonic() - began)
                    self._tokens_per_s = rate if self._tokens_per_s is None else 0.8 * self._tokens_per_s + 0.2 * rate
                except Exception as e:  # noqa: BLE001  (the pass failed for every prompt in it)
                    log.warning("prefill pass of %d chunks failed: %s", len(batch), e)
                    results = [e] * len(batch)
                for (item, start, n), res in zip(batch, results):
                    item.done = start + n
                    if res is not None:
                        self._end(item, res)
        except Exception as e:
            log.exception("prefill queue failed; failing the %d prompts in it", len(self._queue))
            for item in list(self._queue):
                self._end(item, PdError(grpc.StatusCode.INTERNAL, "PREFILL_QUEUE_FAILED", f"prefill queue: {e}"))

    def _plan(self, now: float) -> list[tuple[Queued, int, int]]:
        """The next pass, in queue order; drops every waiting prompt whose caller is gone, wherever it stands."""
        budget, batch, full = self.max_batch_tokens, [], False
        for item in list(self._queue):
            if not item.started and (reason := item.drop_reason(now)) is not None:
                self._drop(item, reason)
                continue
            if full:
                continue
            if not item.started and self._waits_for_prefix(item):
                continue  # the prompts behind it may pass: it will take less than they do once it starts
            if not item.started and not self._start(item):
                full = True  # nothing overtakes it: a large prompt is not starved by small ones
                continue
            rest = len(item.prompt.token_ids) - item.done
            n = min(rest, budget)
            if rest > self.max_batch_tokens and self._is_short_waiting(item):
                n = min(n, max(1, self.max_batch_tokens // 2))
            batch.append((item, item.done, n))
            budget -= n
            full = budget == 0
        return batch

    def _reusable(self, p: Prompt, num_pages: int) -> int:
        """How many leading full pages the prompt may take from the cache."""
        if not self.local.caching or p.prompt_logprobs is not None:
            return 0  # prompt log-probabilities need the logits of every prompt position: such a prompt runs whole
        # each cached page the destination lacks costs a copy: a hit that with its copies would need more pages
        # than the pool has would wait for ever, so it is cut to what fits beside the prompt's own pages
        return max(0, min((len(p.token_ids) - 1) // self.page_size, p.cached_pages + self.local.num_pages - num_pages))

    def _waits_for_prefix(self, item: Queued) -> bool:
        """Whether the first prefix page the cache lacks is being computed by another prompt now."""
        p = item.prompt
        chains = p.chains[:self._reusable(p, item.num_pages)]
        if not chains or not self._computing:
            return False
        nxt = self.local.num_matched(chains)
        waits = nxt < len(chains) and self._computing.get(chains[nxt], p) is not p
        if waits and not item.waited:
            item.waited = True
            PREFIX_WAITS.inc()
        return waits

    def _start(self, item: Queued) -> bool:
        """Gives the prompt its local pages (LocalPages.reserve: the longest prefix the cache holds, then pages of
        its own), or returns False when they do not fit now."""
        p = item.prompt
        res = self.local.reserve(item.num_pages, p.chains, p.cached_pages, self._reusable(p, item.num_pages))
        if res is None:
            return False
        p.reservation = res
        item.done = item.skipped = res.hit * self.page_size
        self._started(item)
        for key in p.chains[res.hit:]:  # the pages it computes and may cache: others wait for them, not redo them
            self._computing.setdefault(key, p)
        return True

    def _is_short_waiting(self, long: Queued) -> bool:
        """Whether a prompt that fits in half a pass waits: only then is the long one slowed down for it (among
        long prompts alone, first come first served finishes the first sooner and the rest no later)."""
        half = self.max_batch_tokens // 2
        return any(item is not long and not item.started and len(item.prompt.token_ids) <= half
                   for item in self._queue)

    def _pass(self, batch: list[tuple[Queued, int, int]]) -> list:
        """In the model's thread. A prompt whose caller went away between planning and now is counted: the bench
        checks that the drop above keeps this at 0."""
        now = time.monotonic()
        first = [item for item, start, _ in batch if start == item.skipped]
        PREFILL_GONE_AT_START.inc(sum(item.drop_reason(now) is not None for item in first))
        PREFILL_SEQUENCES.inc(len(first))
        PREFILL_BATCH.observe(len(batch))
        return self.forward([(item.prompt, start, n) for item, start, n in batch])

    def _drop(self, item: Queued, reason: str) -> None:
        PREFILL_DROPPED.labels(reason).inc()
        what = "while the prompt waited for prefill's forward pass (nothing computed)"
        self._end(item, deadline_exceeded(item.deadline, what) if reason == "deadline" else
                  PdError(grpc.StatusCode.CANCELLED, "CALLER_LEFT", f"the caller left {what}"))

    def _end(self, item: Queued, result: Forward | Exception) -> None:
        self._queue.remove(item)
        self._count_waiting()
        if isinstance(result, Exception):
            item.future.set_exception(result)
        else:
            item.future.set_result(result)

    def _count_waiting(self) -> None:
        self.num_waiting = sum(not item.started for item in self._queue)
        PREFILL_QUEUE.set(self.num_waiting)

    @staticmethod
    def _started(item: Queued) -> None:
        """Planned into its first pass: it holds pages now and is no longer dropped."""
        item.started = True
        QUEUE_SECONDS.labels("prefill").observe(time.monotonic() - item.queued_at)

    async def _wait(self) -> None:
        """Until pages are freed, a caller leaves, or the nearest deadline of a waiting prompt passes."""
        deadlines = [item.deadline for item in self._queue if not item.started and item.deadline is not None]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass
