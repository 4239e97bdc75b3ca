"""The API key on the public gRPC port: a key the HTTP API takes (`--api-keys-file`, `--api-key`, else
PDSERVE_API_KEY; keys.py), sent as `authorization: Bearer KEY` metadata. Health and reflection stay open, as /health
does over HTTP: probes and tooling carry no key, and neither reaches a model or a KV page. The tenant of the key is
looked up again by the servicer (tenant_of_metadata), which fails closed without one."""
from __future__ import annotations

import grpc

from ..common.errors import PdError, to_status
from .keys import ApiKeys

API_KEY = "API_KEY"
OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
        "/grpc.reflection.v1.ServerReflection/")
REFUSAL = PdError(grpc.StatusCode.UNAUTHENTICATED, API_KEY,
                  "missing or wrong API key: send gRPC metadata `authorization: Bearer KEY` with the gateway's key "
                  "(`pdserve generate` sends PDSERVE_API_KEY or --api-key)")


def refused() -> PdError:
    """REFUSAL to raise (a fresh one each time: a raised exception carries its traceback along)."""
    return PdError(REFUSAL.code, REFUSAL.reason, REFUSAL.message)


async def _refuse(request, context):
    await context.abort_with_status(to_status(REFUSAL))


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Outermost on the gateway's public server: a call without the key reaches no handler. Every method but health
    and reflection needs it, so a service added to the port later is closed until someone opens it here."""

    def __init__(self, keys: ApiKeys):
        self._keys = keys
        # one refusing handler per method, built once: a flood of calls without a key allocates no handlers
        self._refusals: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(OPEN) or \
                self._keys.tenant_of_metadata(handler_call_details.invocation_metadata) is not None:
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
