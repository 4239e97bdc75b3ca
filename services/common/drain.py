"""Shared pieces of a service's drain on SIGTERM: the refusal new work gets, and waiting for work to end."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import grpc

from . import tasks
from .errors import PdError

log = logging.getLogger(__name__)

POLL_S = 0.05


def draining_error(service: str, what: str) -> PdError:
    """UNAVAILABLE, so the gateway retries it on another backend before the first token."""
    return PdError(grpc.StatusCode.UNAVAILABLE, "DRAINING", f"{service} is draining (shutting down): {what}")


async def wait_idle(service: str, busy: Callable[[], int], timeout_s: float) -> int:
    """Waits until busy() is 0 or timeout_s has passed; returns what is still busy (0 when idle)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while (n := busy()) and time.monotonic() < deadline:
        if n != last:
            log.info("%s draining: %d still running, %.1fs left", service, n, deadline - time.monotonic())
            last = n
        await asyncio.sleep(POLL_S)
    return busy()


async def settle(timeout_s: float = 5.0) -> None:
    """Lets the give-backs (Release, EndWrite) spawned so far finish before the process exits."""
    pending = set(tasks._RUNNING)
    if pending:
        await asyncio.wait(pending, timeout=timeout_s)
