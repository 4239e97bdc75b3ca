"""A request's deadline (absolute time.monotonic() seconds, or None) bounds every internal call made for it."""
from __future__ import annotations

import time

import grpc

from .errors import PdError


def deadline_of(context) -> float | None:
    """The deadline of an incoming gRPC call, None when the caller set none."""
    left = context.time_remaining()
    return None if left is None else time.monotonic() + left


def timeout_within(deadline: float | None, bound_s: float, what: str) -> float:
    """The timeout for one internal call: its own bound, or less when the deadline is nearer. Past the deadline the
    request ends here, before the call is made."""
    if deadline is None:
        return bound_s
    left = deadline - time.monotonic()
    if left <= 0:
        raise deadline_exceeded(deadline, what)
    return min(bound_s, left)


def deadline_exceeded(deadline: float, what: str) -> PdError:
    # clamped: a callee's own timer may fire a moment before this process's clock reaches the deadline
    late = max(0.0, time.monotonic() - deadline)
    return PdError(grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED",
                   f"the request's deadline passed {late:.3f}s ago, {what}")
