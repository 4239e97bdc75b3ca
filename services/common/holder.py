"""A stand-in servicer registered before the server starts: gRPC aio takes its handlers before start, and the
server must start before the model loads, so that probes get an answer (NOT_SERVING) during a long load."""
from __future__ import annotations

import grpc

from .errors import PdError


class ServicerHolder:
    """Answers every method of one service UNAVAILABLE (reason STARTING) until `servicer` is set, then hands
    each call to it. Built from the service descriptor, so it knows which methods stream."""

    def __init__(self, name: str, service_descriptor):
        self.name = name
        self.servicer = None
        for m in service_descriptor.methods:
            setattr(self, m.name, self._stream(m.name) if m.server_streaming else self._unary(m.name))

    def _method(self, method: str):
        if self.servicer is None:
            raise PdError(grpc.StatusCode.UNAVAILABLE, "STARTING",
                          f"{self.name} is starting (loading its model or reaching the broker); {method} is not "
                          f"served yet")
        return getattr(self.servicer, method)

    def _unary(self, method: str):
        async def handler(request, context):
            return await self._method(method)(request, context)
        return handler

    def _stream(self, method: str):
        async def handler(request, context):
            async for item in self._method(method)(request, context):
                yield item
        return handler
