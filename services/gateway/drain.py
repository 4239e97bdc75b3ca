"""The gateway's drain on SIGTERM: new requests (gRPC and HTTP) are refused UNAVAILABLE (DRAINING), so a client
or load balancer sends them to another gateway; running streams finish within the drain timeout. Those still
open then are cancelled when the server stops, and their decode allocations are given back."""
from __future__ import annotations

import logging

from ..common.drain import wait_idle

log = logging.getLogger(__name__)


async def drain(servicer, timeout_s: float) -> None:
    servicer.draining = True
    left = await wait_idle("gateway", lambda: servicer.active, timeout_s)
    if left:
        log.warning("gateway drain timeout %.1fs: cancelling %d streams still running", timeout_s, left)
