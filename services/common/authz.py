"""Per-method authorisation by the peer's certificate identity (ROLE/NAME in the CN; see tls.py, pki.py).

One table says which roles may call which method; one function says which resources an identity may
name (by prefix, so the broker keeps no extra state). A method missing from the table is refused:
a new RPC is closed until someone decides who may call it.
"""
from __future__ import annotations

import inspect
import logging

import grpc
from prometheus_client import Counter

from .errors import PdError, to_status
from .pki import parse_identity

log = logging.getLogger(__name__)

ANY = frozenset(("broker", "prefill", "decode", "gateway", "operator"))
POLICY: dict[str, frozenset[str]] = {
    "/pdserve.v1.Broker/RegisterPool": frozenset({"decode"}),
    "/pdserve.v1.Broker/Grant": frozenset({"decode"}),
    "/pdserve.v1.Broker/Validate": frozenset({"decode"}),
    "/pdserve.v1.Broker/Release": frozenset({"decode"}),
    "/pdserve.v1.Broker/WatchRevocations": frozenset({"decode"}),
    "/pdserve.v1.Broker/KeepAlive": frozenset({"decode", "prefill"}),
    "/pdserve.v1.Broker/BeginWrite": frozenset({"prefill"}),
    "/pdserve.v1.Broker/EndWrite": frozenset({"prefill"}),
    "/pdserve.v1.Broker/Revoke": frozenset({"operator"}),
    "/pdserve.v1.Broker/GetPoolState": frozenset({"decode", "operator"}),
    "/pdserve.v1.Prefill/Prefill": frozenset({"gateway", "operator"}),
    "/pdserve.v1.Prefill/GetInfo": frozenset({"gateway", "operator"}),
    "/pdserve.v1.Decode/Allocate": frozenset({"gateway", "operator"}),
    "/pdserve.v1.Decode/Decode": frozenset({"gateway", "operator"}),
    "/pdserve.v1.Decode/Run": frozenset({"gateway", "operator"}),
    "/pdserve.v1.Decode/Release": frozenset({"gateway", "operator"}),
    "/pdserve.v1.Decode/GetInfo": frozenset({"gateway", "operator"}),
    "/pdserve.v1.Faults/*": frozenset({"operator"}),
    "/grpc.health.v1.Health/*": ANY,
    "/grpc.reflection.v1alpha.ServerReflection/*": ANY,
    "/grpc.reflection.v1.ServerReflection/*": ANY,
}
# request fields that name something a role owns: its own ids all start with "ROLE/NAME/"
OWNED_FIELDS = {"decode": ("pool_id", "holder_id"), "prefill": ("writer_id", "holder_id")}

NO_IDENTITY, BAD_IDENTITY = "NO_PEER_IDENTITY", "BAD_PEER_IDENTITY"
ROLE, RESOURCE, UNLISTED = "ROLE_NOT_ALLOWED", "NOT_OWN_RESOURCE", "METHOD_NOT_IN_POLICY"
REASONS = (NO_IDENTITY, BAD_IDENTITY, ROLE, RESOURCE, UNLISTED)
DENIALS = Counter("pdserve_auth_denials_total", "Calls refused by mutual-TLS authorisation",
                  ["service", "method", "reason"])


def allowed_roles(method: str) -> frozenset[str] | None:
    """Roles that may call a full method name ('/pkg.Service/Method'); None when it is not in the table."""
    return POLICY.get(method, POLICY.get(method.rsplit("/", 1)[0] + "/*"))


def check_call(method: str, cn: str | None) -> tuple[str, str] | None:
    """None when the peer may call the method at all, else the denial (reason, message)."""
    if not cn:
        return NO_IDENTITY, f"{method}: the peer presented no certificate identity"
    try:
        role, _ = parse_identity(cn)
    except ValueError as e:
        return BAD_IDENTITY, f"{method}: {e}"
    roles = allowed_roles(method)
    if roles is None:
        return UNLISTED, f"{method} is not in the authorisation policy; refused for every caller"
    if role not in roles:
        return ROLE, f"{method} is for {'/'.join(sorted(roles))}, not {cn}"
    return None


# fields that may be left empty, naming nothing: KeepAlive's pool_id is set only on a reader's renewal
OPTIONAL_FIELDS = {("KeepAlive", "pool_id")}


def check_resource(method: str, cn: str, request) -> tuple[str, str] | None:
    """A decode names only its own pools (and KeepAlive holders), a prefill only its own writer ids."""
    fields = OWNED_FIELDS.get(cn.partition("/")[0], ())
    present = getattr(getattr(request, "DESCRIPTOR", None), "fields_by_name", {})
    for name in fields:
        if name in present:
            value = getattr(request, name)
            if not value and (method.rsplit("/", 1)[-1], name) in OPTIONAL_FIELDS:
                continue
            if not value.startswith(cn + "/"):
                return RESOURCE, f"{method}: {cn} may only name a {name} that starts with {cn + '/'!r}, not {value!r}"
    return None


def _peer_cn(context) -> str | None:
    names = context.auth_context().get("x509_common_name") or []
    return names[0].decode("utf-8", "replace") if names else None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks the peer's identity before any handler runs; wraps each method's handler once."""

    def __init__(self, service: str, full_service_names: list[str]):
        self._service = service
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}
        for method in POLICY:  # every series at 0 from start-up, for the methods this server has
            if method.split("/")[1] in full_service_names and not method.endswith("/*"):
                for reason in REASONS:
                    DENIALS.labels(service, method.rsplit("/", 1)[1], reason)

    async def intercept_service(self, continuation, handler_call_details):
        key = handler_call_details.method
        if key in self._wrapped:
            return self._wrapped[key]
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        self._wrapped[key] = wrapped = self._wrap(handler, key)
        return wrapped

    async def _deny_if_needed(self, method: str, request, context) -> None:
        cn = _peer_cn(context)
        denial = check_call(method, cn)
        if denial is None and request is not None:
            denial = check_resource(method, cn, request)
        if denial is None:
            return
        reason, message = denial
        code = grpc.StatusCode.UNAUTHENTICATED if reason in (NO_IDENTITY, BAD_IDENTITY) \
            else grpc.StatusCode.PERMISSION_DENIED
        DENIALS.labels(self._service, method.rsplit("/", 1)[1], reason).inc()
        log.warning("denied %s from %s (%s): %s", method, context.peer(), reason, message)
        await context.abort_with_status(to_status(PdError(code, reason, message)))

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        deny = self._deny_if_needed
        if handler.unary_unary or handler.stream_unary:
            fn, unary_request = handler.unary_unary or handler.stream_unary, bool(handler.unary_unary)

            async def unary_response(request, context):
                await deny(method, request if unary_request else None, context)
                result = fn(request, context)
                return await result if inspect.isawaitable(result) else result
            make = grpc.unary_unary_rpc_method_handler if unary_request else grpc.stream_unary_rpc_method_handler
            return make(unary_response, handler.request_deserializer, handler.response_serializer)
        fn, unary_request = handler.unary_stream or handler.stream_stream, bool(handler.unary_stream)
        make = grpc.unary_stream_rpc_method_handler if unary_request else grpc.stream_stream_rpc_method_handler
        if inspect.isasyncgenfunction(fn):
            async def stream_response(request, context):
                await deny(method, request if unary_request else None, context)
                async for item in fn(request, context):
                    yield item
        else:  # a handler that writes with context.write() and returns
            async def stream_response(request, context):
                await deny(method, request if unary_request else None, context)
                result = fn(request, context)
                return await result if inspect.isawaitable(result) else result
        return make(stream_response, handler.request_deserializer, handler.response_serializer)
