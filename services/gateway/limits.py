"""The gateway's per-server concurrency limit: Generate calls (gRPC and HTTP together) past it are refused at
once with RESOURCE_EXHAUSTED OVERLOADED and a retry delay, instead of queueing until deadlines expire deep
inside the stack.

The retry delay is an estimate of when a slot frees: with `over` calls to finish before one is free (the
running ones beyond the limit, plus one) and admitted calls finishing at `rate` per second over the last
WINDOW_S seconds (or since start-up), `over / rate`. When none finished in the window, no slot is likely to free sooner than that
window: WINDOW_S. Clamped to [MIN_DELAY_S, MAX_DELAY_S]; HTTP rounds it up to whole seconds (at least 1)."""
from __future__ import annotations

import asyncio
import collections
import time

import grpc

from ..common.errors import PdError
from ..common.metrics import OVERLOAD_REJECTIONS

WINDOW_S = 10.0
MIN_DELAY_S = 0.05
MAX_DELAY_S = 60.0
DEFAULT_MAX_CONCURRENT = 1024


class ConcurrencyLimit:
    """enter(active) once a call is admitted; the calls it lets in are timed to their end (their task's end:
    each gRPC call and each HTTP choice runs in a task of its own), which is what the retry delay is made of."""

    def __init__(self, max_requests: int = 0, clock=time.monotonic):
        if max_requests < 0:
            raise ValueError(f"max_requests must be >= 0 (0: no limit), got {max_requests}")
        self.max_requests = max_requests
        self._clock = clock
        self._since = clock()
        self._ended: collections.deque[float] = collections.deque(maxlen=1024)  # end times, newest last
        OVERLOAD_REJECTIONS.labels("gateway", "concurrency")  # exported at 0 from start-up

    def enter(self, active: int) -> None:
        """active: the calls running now, this one included. Raises OVERLOADED when that is over the limit."""
        if not self.max_requests:
            return
        if active > self.max_requests:
            OVERLOAD_REJECTIONS.labels("gateway", "concurrency").inc()
            delay = self.retry_after_s(active - self.max_requests)
            raise PdError(grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED",
                          f"{active - 1} requests are running on this gateway (limit {self.max_requests}, "
                          f"--max-concurrent-requests); retry in {delay:.2f}s", delay)
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(self._done)

    def _done(self, _task) -> None:
        self._ended.append(self._clock())

    def retry_after_s(self, over: int) -> float:
        now = self._clock()
        while self._ended and self._ended[0] < now - WINDOW_S:
            self._ended.popleft()
        if not self._ended:
            return WINDOW_S
        full = len(self._ended) == self._ended.maxlen  # then the kept ends span less than the window
        start = self._ended[0] if full else max(now - WINDOW_S, self._since)
        rate = len(self._ended) / max(now - start, 1e-3)
        return min(MAX_DELAY_S, max(MIN_DELAY_S, over / rate))
