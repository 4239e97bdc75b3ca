"""Decode's drain on SIGTERM: no new allocation; running streams finish, and allocations already granted get
their Decode call, within the drain timeout; past it the rest end UNAVAILABLE (DRAINING). Every lease is
released before the process exits, so the broker sees the pool empty rather than revoking after its TTL."""
from __future__ import annotations

import logging

from ..common.drain import draining_error, settle, wait_idle

log = logging.getLogger(__name__)


def _busy(servicer) -> int:
    return servicer.queue_depth() + len(servicer.pending_grants)


async def drain(servicer, timeout_s: float) -> None:
    servicer.draining = True
    servicer.queue.pages_may_be_free()  # requests waiting for pages are refused (retryable elsewhere), not kept
    left = await wait_idle("decode", lambda: _busy(servicer), timeout_s)
    if left:
        s = servicer.scheduler
        log.warning("decode drain timeout %.1fs: failing %d running and %d joining requests, releasing %d "
                    "allocations that never got their Decode call", timeout_s, len(s.running), len(s.joining),
                    len(servicer.allocations))
        err = draining_error("decode", f"its {timeout_s:g}s drain timeout ended this stream")
        s.fail_all(err)
        # popped in one step: a Run waiting for its notice ends with this (retryable) error, not REVOKED
        for owner, alloc in servicer.allocations.end_all(err):
            await servicer.release(owner, alloc.epoch, alloc.leases)
        # the scheduler ends marked sequences between steps and releases their pages
        await wait_idle("decode", lambda: _busy(servicer), 5.0)
    await settle()
