"""Prefill's drain on SIGTERM: no new Prefill call; those in flight finish within the drain timeout, else their
callers get UNAVAILABLE (DRAINING) and the gateway retries them on another prefill, before any token was sent.
A write still running then goes on to its EndWrite while the process winds down; if the process is gone
first, the broker presumes the writer dead after its liveness lease and holds the pages for lock_delay."""
from __future__ import annotations

import logging

from ..common.drain import settle, wait_idle

log = logging.getLogger(__name__)


async def drain(servicer, timeout_s: float) -> None:
    servicer.draining = True
    left = await wait_idle("prefill", lambda: len(servicer.in_flight), timeout_s)
    if left:
        log.warning("prefill drain timeout %.1fs: %d Prefill calls fail UNAVAILABLE (DRAINING) for a retry "
                    "elsewhere", timeout_s, left)
        servicer.drain_expired.set()
        # a write that already posted acknowledges itself once its transport call returns
        await wait_idle("prefill", lambda: len(servicer.in_flight), 2.0)
    await settle(timeout_s=2.0)
