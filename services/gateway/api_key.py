"""The API key on the public gRPC port: the key the HTTP API asks for (`--api-key`, else PDSERVE_API_KEY), sent as
`authorization: Bearer KEY` metadata. Health and reflection stay open, as /health does over HTTP: probes and
tooling carry no key, and neither reaches a model or a KV page."""
from __future__ import annotations

import hmac

import grpc

from ..common.errors import PdError, to_status

API_KEY = "API_KEY"
OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
        "/grpc.reflection.v1.ServerReflection/")
REFUSAL = PdError(grpc.StatusCode.UNAUTHENTICATED, API_KEY,
                  "missing or wrong API key: send gRPC metadata `authorization: Bearer KEY` with the gateway's key "
                  "(`pdserve generate` sends PDSERVE_API_KEY or --api-key)")


def has_key(metadata, expected: bytes) -> bool:
    """Exactly one `authorization` entry, equal to `Bearer KEY` in constant time: two entries could make a proxy
    and this check read different ones."""
    given = [value for key, value in metadata or () if key == "authorization"]
    if len(given) != 1:
        return False
    value = given[0] if isinstance(given[0], bytes) else given[0].encode()
    return hmac.compare_digest(value, expected)


async def _refuse(request, context):
    await context.abort_with_status(to_status(REFUSAL))


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Outermost on the gateway's public server: a call without the key reaches no handler. Every method but health
    and reflection needs it, so a service added to the port later is closed until someone opens it here."""

    def __init__(self, key: str):
        if not key:
            raise ValueError("an empty API key would let every caller in")
        self._expected = b"Bearer " + key.encode()
        # one refusing handler per method, built once: a flood of calls without a key allocates no handlers
        self._refusals: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(OPEN) or has_key(handler_call_details.invocation_metadata, self._expected):
            return await continuation(handler_call_details)
        if method in self._refusals:
            return self._refusals[method]
        handler = await continuation(handler_call_details)
        if handler is None:  # not cached: a client naming random methods must not grow the table
            return None
        self._refusals[method] = refusal = _refusing(handler)
        return refusal


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind that aborts; the request is left as bytes, never parsed for an unknown caller."""
    make = (grpc.unary_unary_rpc_method_handler if handler.unary_unary else
            grpc.unary_stream_rpc_method_handler if handler.unary_stream else
            grpc.stream_unary_rpc_method_handler if handler.stream_unary else grpc.stream_stream_rpc_method_handler)
    return make(_refuse, None, handler.response_serializer)
