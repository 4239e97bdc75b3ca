"""Decode's drain on SIGTERM: no new allocation; running streams finish, and allocations already granted get
their Decode call, within the drain timeout. What still runs then is handed back, never cut: each stream ends
UNAVAILABLE DRAINED carrying the tokens it streamed (`tokens_streamed`, the contract of a preemption), so the
gateway resubmits prompt + those tokens to another decode and the client's stream goes on there. An allocation
that never got its Decode call streamed nothing: it ends UNAVAILABLE DRAINING, which the gateway retries elsewhere
before the first token. Every lease is released before the process exits, so the broker sees the pool empty
rather than revoking after its TTL."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from ..common.drain import POLL_S, draining_error, settle, wait_idle
from ..common.errors import PdError
from .requests import State
from .sequence import Sequence

log = logging.getLogger(__name__)

# A joining sequence (verifying its prompt, sending its first token) is handed back only once it runs: only then is
# the count of tokens it sent exact. This bounds that wait, and the end of the streams handed back.
HAND_BACK_S = 5.0


def _busy(servicer) -> int:
    return servicer.queue_depth() + servicer.requests.count(State.GRANTING)


def drained(seq: Sequence, timeout_s: float) -> PdError:
    """The retryable end of a stream still running when the drain timeout ends: every token it generated has gone
    down its stream before this error (its events are in order), so `tokens_streamed` is what the client has of this
    submission."""
    n = len(seq.generated)
    return PdError(grpc.StatusCode.UNAVAILABLE, "DRAINED",
                   f"decode is draining (shutting down): request {seq.owner.hex()} was still running at the end of "
                   f"its {timeout_s:g}s drain timeout and is handed back after {n} tokens, to go on at another "
                   f"decode", metadata={"tokens_streamed": str(n)})


async def drain(servicer, timeout_s: float) -> None:
    servicer.draining = True
    servicer.queue.pages_may_be_free()  # requests waiting for pages are refused (retryable elsewhere), not kept
    left = await wait_idle("decode", lambda: _busy(servicer), timeout_s)
    if left:
        s = servicer.requests
        log.warning("decode drain timeout %.1fs: handing back %d running and %d joining requests, releasing %d "
                    "allocations that never got their Decode call", timeout_s, len(s.running), len(s.joining),
                    len(servicer.allocations))
        # popped in one step: a Run waiting for its notice ends with this (retryable) error, not REVOKED
        err = draining_error("decode", f"its {timeout_s:g}s drain timeout ended this request before its first token")
        for owner, alloc in s.end_allocations(err):
            await servicer.release(owner, alloc.epoch, alloc.leases)
        await _hand_back(servicer, timeout_s)
    await settle()


async def _hand_back(servicer, timeout_s: float) -> None:
    """Marks every running stream DRAINED (the scheduler ends it between steps and releases its pages), again
    each poll as joining ones start running, until decode is idle. A sequence still joining after HAND_BACK_S
    ends DRAINING: fail closed, the count of tokens it sent is not known here."""
    s = servicer.requests
    deadline = time.monotonic() + HAND_BACK_S
    while _busy(servicer) and time.monotonic() < deadline:
        for seq in list(s.running.values()):
            if not seq.cancelled:
                s.mark(seq, drained(seq, timeout_s))
        await asyncio.sleep(POLL_S)
    if s.joining:
        log.warning("decode drain: %d requests still joining %gs after the drain timeout end DRAINING",
                    len(s.joining), HAND_BACK_S)
        s.fail_all(draining_error("decode", f"its {timeout_s:g}s drain timeout ended this stream before it ran"))
        await wait_idle("decode", lambda: _busy(servicer), HAND_BACK_S)
