"""The OpenAI error object ({message, type, param, code}) and the statuses that make the official client
retry only what is transient: 429/503 carry Retry-After, a 500 that a retry cannot fix carries
x-should-retry: false (openai-python's `_should_retry` obeys that header before it looks at the status).

Retry-After is the error's own estimate (PdError.retry_after_s, from the gateway's concurrency limit or a backend's
RetryInfo) rounded up to whole seconds, at least 1; an error without an estimate (no backend, draining) says 1."""
from __future__ import annotations

import math

import grpc
from fastapi.responses import JSONResponse

from ...common.errors import PdError

MIN_RETRY_AFTER_S = 1
STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
          grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.CANCELLED: 499,
          grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
          grpc.StatusCode.DEADLINE_EXCEEDED: 504}
# refused at admission (INVALID_ARGUMENT, so gRPC clients do not retry it on the same gateway), yet transient
BY_REASON = {"OVERLOADED": 429}
TYPES = {401: "authentication_error", 429: "rate_limit_error"}
NO_RETRY = {grpc.StatusCode.DATA_LOSS, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
            grpc.StatusCode.UNIMPLEMENTED}


def retry_after(seconds: float | None) -> int:
    """Whole seconds for Retry-After: the estimate rounded up, never under MIN_RETRY_AFTER_S."""
    return max(MIN_RETRY_AFTER_S, math.ceil(seconds or 0))


class ApiError(Exception):
    """An HTTP-level refusal: status, OpenAI code (snake case) and the field it is about."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param
        self.headers = headers or {}

    @classmethod
    def from_pd(cls, e: PdError) -> "ApiError":
        status = BY_REASON.get(e.reason, STATUS.get(e.code, 500))
        headers = {}
        if status in (429, 503):
            headers["Retry-After"] = str(retry_after(e.retry_after_s))
        if e.code in NO_RETRY:
            headers["x-should-retry"] = "false"
        return cls(status, e.reason.lower(), f"{e.code.name} {e.reason}: {e.message}", headers=headers)

    @classmethod
    def internal(cls, request_id: str) -> "ApiError":
        """A failure of the gateway itself: the client gets the request id to quote, never the exception, whose text
        may hold internal names, paths or another request's data; the log has it under that id."""
        return cls(500, "internal_error", f"internal error; the gateway's log has the details under request id "
                                          f"{request_id}", headers={"x-should-retry": "false"})

    def body(self) -> dict:
        kind = TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = dict(self.headers)
        if self.status in (408, 413, 431):
            headers["Connection"] = "close"  # the rest of an unread body must not be parsed as a next request
        return JSONResponse(self.body(), status_code=self.status, headers=headers)
