"""Typed errors: every failure carries a gRPC code and a machine-readable reason (google.rpc.ErrorInfo), and an
overload refusal how long to wait before trying again (google.rpc.RetryInfo)."""
from __future__ import annotations

import functools
import math

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "pdserve"


class PdError(Exception):
    """An error with a gRPC status code and a reason; raised by engine and service code alike.
    retry_after_s: the sender's estimate of when a retry may succeed (overload refusals), else None.
    metadata: machine-readable facts of the error (ErrorInfo.metadata), e.g. how many tokens a preempted
    request had streamed."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str, retry_after_s: float | None = None,
                 metadata: dict[str, str] | None = None):
        super().__init__(message)
        if retry_after_s is not None and not (math.isfinite(retry_after_s) and retry_after_s >= 0):
            raise ValueError(f"retry_after_s must be a finite number >= 0, got {retry_after_s}")
        self.code = code
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s
        self.metadata = dict(metadata or {})

    def prefixed(self, what: str) -> "PdError":
        """The same error (code, reason, retry delay) with where it happened in front of its message."""
        return PdError(self.code, self.reason, f"{what}: {self.message}", self.retry_after_s, self.metadata)

    def __str__(self) -> str:
        retry = "" if self.retry_after_s is None else f" (retry after {self.retry_after_s:.3f}s)"
        return f"{self.code.name} {self.reason}: {self.message}{retry}"


def invalid(reason: str, message: str) -> PdError:
    return PdError(grpc.StatusCode.INVALID_ARGUMENT, reason, message)


def to_status(err: PdError) -> grpc.Status:
    return _status(err.code, err.reason, err.message, err.retry_after_s, tuple(sorted(err.metadata.items())))


@functools.lru_cache(maxsize=256)
def _status(code: grpc.StatusCode, reason: str, message: str, retry_after_s: float | None,
            metadata: tuple[tuple[str, str], ...] = ()) -> grpc.Status:
    """Cached: a flood of one refusal (the same over-long prompt, the same overload) builds its status once."""
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=dict(metadata)))
    details = [info]
    if retry_after_s is not None:
        retry = any_pb2.Any()
        retry.Pack(error_details_pb2.RetryInfo(retry_delay=_duration(retry_after_s)))
        details.append(retry)
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=details))


def _duration(seconds: float) -> duration_pb2.Duration:
    whole = int(seconds)
    return duration_pb2.Duration(seconds=whole, nanos=min(999_999_999, round((seconds - whole) * 1e9)))


async def abort(context: grpc.aio.ServicerContext, err: PdError) -> None:
    """Ends the RPC with err's code, message, ErrorInfo reason and RetryInfo."""
    await context.abort_with_status(to_status(err))


def from_rpc_error(e: grpc.RpcError) -> PdError:
    """Recovers code, reason, message and retry delay from a failed call (reason 'UNKNOWN' when none was
    attached, retry_after_s None when no RetryInfo was)."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    reason = "UNKNOWN"
    retry_after_s = None
    metadata: dict[str, str] = {}
    status = None
    try:
        status = rpc_status.from_call(e)
    except Exception:  # a status without rich details is still a status
        status = None
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason
                metadata = dict(info.metadata)
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                detail.Unpack(retry)
                # a negative delay (malformed) means "now", not "never mind"
                retry_after_s = max(0.0, retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9)
    details = e.details() if hasattr(e, "details") else str(e)
    return PdError(code, reason, details or "", retry_after_s, metadata)
