"""The FastAPI application: request ids and the API key (and with it the tenant) around every route, each answer
counted by route and status, the error object for every failure, /health, /v1/models and the two generation
routes."""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from ...common.drain import draining_error
from ...common.errors import PdError
from ..keys import NO_KEYS_TENANT, ApiKeys
from ..scope import check_cache_salt
from . import chat, completions
from .errors import ApiError
from .generation import ClientGone
from .http_metrics import CountRequests, RouteLabels
from .server import Limits, largest_request_bytes

log = logging.getLogger(__name__)
MAX_REQUEST_ID = 128


class Front:
    """What the routes share: the servicer (admission, tokenizer, capacity), the served names and limits. A request
    may name any of the names; responses report the first (`model`), as vLLM's --served-model-name documents."""

    def __init__(self, servicer, names: Sequence[str], limits: Limits, template=None):
        if isinstance(names, str) or not names:
            raise TypeError(f"names must be a non-empty sequence of names, got {names!r}")
        if limits.max_body_bytes is None:
            cap = servicer.cap
            limits = dataclasses.replace(limits, max_body_bytes=largest_request_bytes(
                cap.context_length, cap.vocab_size, servicer.tokenizer.max_chars_per_token))
            log.info("gateway: HTTP bodies up to %d bytes: the largest legal request of context %d, vocabulary %d "
                     "(--http-max-body-bytes)", limits.max_body_bytes, cap.context_length, cap.vocab_size)
        self.servicer, self.names, self.limits, self.template = servicer, tuple(names), limits, template
        self.model = self.names[0]
        self.created = int(time.time())

    def check(self, body) -> None:
        """What both generation routes refuse before any work: another model, stream_options without a
        stream, a draining gateway."""
        if body.model is not None and body.model not in self.names:
            served = ", ".join(f"`{n}`" for n in self.names)
            raise ApiError(404, "model_not_found", f"the model `{body.model}` does not exist; this server "
                                                   f"serves {served}", param="model")
        opts = body.stream_options
        if opts is not None and not body.stream:
            raise ApiError(400, "invalid_value", "stream_options needs stream: true", param="stream_options")
        if opts is not None and opts.continuous_usage_stats and not opts.include_usage:
            raise ApiError(400, "invalid_value", "stream_options.continuous_usage_stats needs include_usage: true",
                           param="stream_options.continuous_usage_stats")
        if body.cache_salt is not None:
            if not body.cache_salt:  # as vLLM: an empty salt is a client's mistake, not "no salt"
                raise ApiError(400, "invalid_value", "cache_salt must be a non-empty string if given",
                               param="cache_salt")
            try:
                check_cache_salt(body.cache_salt)
            except PdError as e:
                raise ApiError(400, "invalid_value", e.message, param="cache_salt") from None
        if self.servicer.draining:
            raise ApiError.from_pd(draining_error("gateway", "new requests are refused; send them to another "
                                                             "gateway"))


class Envelope:
    """Pure ASGI (a BaseHTTPMiddleware would buffer streams and hide disconnects): X-Request-Id in (echoed)
    or out (made up), and the API key on everything but /health; the key's tenant goes to the routes as
    request.state.tenant."""

    def __init__(self, app, keys: ApiKeys | None):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id", b"")
        err = None
        if not 0 < len(rid) <= MAX_REQUEST_ID:
            if rid:
                err = ApiError(400, "bad_request_id", f"X-Request-Id is {len(rid)} bytes; the limit is "
                                                      f"{MAX_REQUEST_ID}", param="X-Request-Id")
            rid = f"req-{uuid.uuid4().hex}".encode()
        state = scope.setdefault("state", {})
        state["request_id"] = rid.decode("latin-1")

        async def send_with_id(msg):
            if msg["type"] == "http.response.start":
                msg["headers"] = [*msg.get("headers", []), (b"x-request-id", rid)]
            await send(msg)

        state["tenant"] = NO_KEYS_TENANT if self.keys is None else None
        if err is None and self.keys is not None and scope["path"] != "/health":
            # one Authorization header, as over gRPC: a proxy and this check could read different ones of two
            given = [v for k, v in scope["headers"] if k == b"authorization"]
            state["tenant"] = self.keys.tenant_of(given[0]) if len(given) == 1 else None
            if state["tenant"] is None:
                err = ApiError(401, "invalid_api_key", "missing or wrong API key (Authorization: Bearer ...)")
        if err is not None:
            return await err.response()(scope, receive, send_with_id)
        await self.app(scope, receive, send_with_id)


def create_app(front: Front, keys: ApiKeys | None) -> CountRequests:
    app = FastAPI(title="pdserve", openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, e: ClientGone):
        return Response(status_code=499)  # nobody reads it: uvicorn drops it with the connection

    @app.exception_handler(PdError)
    async def _pd_error(request: Request, e: PdError):
        return ApiError.from_pd(e).response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return ApiError(e.status_code, code, f"{request.method} {request.url.path}: {e.detail}").response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return ApiError(400, "invalid_value", str(e.errors()[:3])).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        rid = request.state.request_id
        log.error("http request %s failed", rid, exc_info=e)
        return ApiError.internal(rid).response()

    @app.get("/health")
    async def health():
        """200 only while a request could be served: not draining, and a prefill and a decode take work (as the
        gRPC health); otherwise 503 saying which role has no backend."""
        if front.servicer.draining:
            return ApiError.from_pd(draining_error("gateway", "it takes no new requests")).response()
        for router in (front.servicer.prefills, front.servicer.decodes):
            if not router.backends:
                return ApiError.from_pd(router.no_backend()).response()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        cap = front.servicer.cap
        return {"object": "list", "data": [{"id": name, "object": "model", "created": front.created,
                                            "owned_by": "pdserve", "max_model_len": cap.context_length}
                                           for name in front.names]}

    @app.post("/v1/completions")
    async def _completions(request: Request):
        return await completions.handle(front, request)

    @app.post("/v1/chat/completions")
    async def _chat(request: Request):
        return await chat.handle(front, request)

    return CountRequests(Envelope(app, keys), RouteLabels(app.routes))
