"""Typed errors: every failure carries a gRPC code and a machine-readable reason (google.rpc.ErrorInfo)."""
from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "pdserve"


class PdError(Exception):
    """An error with a gRPC status code and a reason; raised by engine and service code alike."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.name} {self.reason}: {self.message}"


def invalid(reason: str, message: str) -> PdError:
    return PdError(grpc.StatusCode.INVALID_ARGUMENT, reason, message)


def to_status(err: PdError) -> grpc.Status:
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN))
    return rpc_status.to_status(status_pb2.Status(code=err.code.value[0], message=err.message, details=[info]))


async def abort(context: grpc.aio.ServicerContext, err: PdError) -> None:
    """Ends the RPC with err's code, message and ErrorInfo reason."""
    await context.abort_with_status(to_status(err))


def from_rpc_error(e: grpc.RpcError) -> PdError:
    """Recovers code, reason and message from a failed call (reason 'UNKNOWN' when none was attached)."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    reason = "UNKNOWN"
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
    details = e.details() if hasattr(e, "details") else str(e)
    return PdError(code, reason, details or "")
