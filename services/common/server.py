"""Server helpers shared by every service: interceptors, health, reflection, metrics, shutdown."""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
import time
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import Histogram, start_http_server

from .authz import AuthInterceptor
from .errors import PdError, to_status
from .faults import add_faults_service
from .holder import ServicerHolder
from .tls import TlsConfig

log = logging.getLogger(__name__)


def freeze_startup_objects() -> int:
    """What start-up allocated (modules, torch, the model, stubs: ~336,000 objects the collector tracks in a decode
    process) lives as long as the process, yet every full collection walks it: one took 337 ms, a stop of every
    stream the process serves. Once ready, a service collects what start-up left as garbage and moves the rest out
    of the collector's reach; later collections walk only what serving allocated. Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


RPC_SECONDS = Histogram("pdserve_rpc_seconds", "Server-side RPC latency", ["method"])
# Keepalive on every server and channel: a dead peer on a long-lived stream (decode's revocation watch, a
# token stream) is noticed in about 1.5 s and the channel reconnects, instead of waiting on TCP for minutes.
# Safety never rests on it (decode's blind bound, from the stream's own heartbeats, does); it only brings a
# stream back sooner. The server must permit pings at least as often as clients send them, with or without
# calls, or it answers with GOAWAY (too_many_pings). Reconnect backoff is capped so a healed link is used soon.
# Between services a message carries up to a 1,048,576-token prompt's ids (5 MiB as varints) and its answers: 64 MiB.
# The gateway's public port receives less (gateway/request_size.py): what the largest legal request needs.
MAX_MESSAGE_BYTES = 64 << 20
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.keepalive_time_ms", 500), ("grpc.keepalive_timeout_ms", 1000),
                ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
                ("grpc.http2.min_ping_interval_without_data_ms", 400),
                ("grpc.http2.min_time_between_pings_ms", 400),
                ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]


def _wrap_unary(fn, method):
    async def handler(request, context):
        start = time.perf_counter()
        try:
            return await fn(request, context)
        except PdError as e:
            await context.abort_with_status(to_status(e))
        finally:
            RPC_SECONDS.labels(method).observe(time.perf_counter() - start)
    return handler


def _wrap_stream(fn, method):
    async def handler(request, context):
        start = time.perf_counter()
        try:
            async for item in fn(request, context):
                yield item
        except PdError as e:
            await context.abort_with_status(to_status(e))
        finally:
            RPC_SECONDS.labels(method).observe(time.perf_counter() - start)
    return handler


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns a PdError raised anywhere in a handler into its status + ErrorInfo reason. The wrapped handler
    is built once per method, not once per call (a flood of rejected requests pays for every allocation)."""

    def __init__(self):
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, handler_call_details):
        key = handler_call_details.method
        if key in self._wrapped:
            return self._wrapped[key]
        handler = await continuation(handler_call_details)
        if handler is None:  # not cached: a client naming random methods must not grow the cache
            return None
        self._wrapped[key] = wrapped = self._wrap(handler, key.rsplit("/", 1)[-1])
        return wrapped

    @staticmethod
    def _wrap(handler, method: str):
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method), handler.request_deserializer,
                handler.response_serializer)
        return handler


class _Refused(Exception):
    """A SystemExit of start-up work, carried as a plain error: raised in a task of its own, asyncio lets a
    SystemExit escape the event loop at once, before the server is stopped, and the loop closes under it (the
    server's clean-up then prints a `RuntimeError: Event loop is closed` traceback after the message)."""

    def __init__(self, exit: SystemExit):
        super().__init__(str(exit))
        self.exit = exit


async def _refusal_as_error(work: Awaitable):
    try:
        return await work
    except SystemExit as e:
        raise _Refused(e) from None


class Service:
    """One gRPC server with stock health (NOT_SERVING until ready), reflection and a /metrics port.
    With tls, the port demands a client certificate and every call is authorised by its identity (authz.py);
    tls=None is plaintext with no authorisation: the gateway's public API, or an explicit --insecure."""

    def __init__(self, name: str, full_service_names: list[str], host: str, port: int, metrics_port: int, *,
                 tls: TlsConfig | None, metrics_host: str = "127.0.0.1", guards: tuple = (),
                 max_receive_bytes: int = MAX_MESSAGE_BYTES):
        """guards: interceptors that refuse callers (the gateway's API key), outermost. max_receive_bytes: a
        larger request is refused RESOURCE_EXHAUSTED by gRPC itself, before it is parsed."""
        self.name = name
        interceptors = [*guards, ErrorInterceptor()]
        if tls is not None:  # outermost: a refused caller reaches no handler and no other interceptor
            interceptors.insert(0, AuthInterceptor(name, full_service_names))
        options = [(k, max_receive_bytes if k == "grpc.max_receive_message_length" else v) for k, v in GRPC_OPTIONS]
        self.server = grpc.aio.server(interceptors=interceptors, options=options)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(full_service_names + [reflection.SERVICE_NAME, health.SERVICE_NAME],
                                            self.server)
        add_faults_service(self.server)
        self.full_service_names = full_service_names
        address = f"{host}:{port}"
        if tls is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, tls.server_credentials())
        if self.port == 0:
            raise RuntimeError(f"{name}: cannot bind gRPC port {host}:{port}")
        self.metrics_host, self.metrics_port = metrics_host, metrics_port
        self._stop = asyncio.Event()

    def hold(self, add_to_server, service_descriptor) -> ServicerHolder:
        """Registers a holder for one service before start; set its `servicer` once the model is loaded."""
        holder = ServicerHolder(self.name, service_descriptor)
        add_to_server(holder, self.server)
        return holder

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        for svc in ["", *self.full_service_names]:
            await self.health.set(svc, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        httpd, _ = start_http_server(self.metrics_port, addr=self.metrics_host)
        self.metrics_port = httpd.server_port
        log.info("%s: answering health (NOT_SERVING) on port %d while it starts", self.name, self.port)

    def _on_signal(self, sig: int) -> None:
        if self._stop.is_set():
            log.warning("%s: %s again while draining; still draining", self.name, signal.Signals(sig).name)
        self._stop.set()

    async def starting(self, work: Awaitable):
        """Runs start-up work (model load, registration) unless a stop signal comes first; then the process
        exits 0 at once: a model load in a thread cannot be cancelled, and there is nothing to drain yet.
        A refusal (SystemExit: a short pool, a broken timing bound) stops the server, then exits with its one
        line."""
        task = asyncio.ensure_future(_refusal_as_error(work))
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            stop.cancel()
            err = task.exception()
            if err is not None:  # e.g. a refused checkpoint: stopped here, not torn down by the GC
                await self.server.stop(0)
            if isinstance(err, _Refused):
                raise err.exit from None
            return task.result()
        log.info("%s: stopped during start-up; exiting", self.name)
        logging.shutdown()
        sys.stdout.flush()
        os._exit(0)

    async def set_serving(self, healthy: bool = True) -> None:
        """Ready: prints the ready line; health SERVING unless healthy=False (a standby: set_health later)."""
        freeze_startup_objects()
        await self.set_health(healthy)
        # one parseable line: tests and `pdserve up` start services on port 0 and read it
        print(f"PDSERVE_READY service={self.name} port={self.port} metrics_port={self.metrics_port}", flush=True)
        log.info("%s serving on port %d, metrics on %s:%d", self.name, self.port, self.metrics_host, self.metrics_port)

    async def set_health(self, healthy: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if healthy else health_pb2.HealthCheckResponse.NOT_SERVING
        for svc in ["", *self.full_service_names]:
            await self.health.set(svc, status)

    def request_stop(self) -> None:
        """Stops as SIGTERM does: wait_for_termination drains and returns."""
        self._stop.set()

    async def wait_for_termination(self, grace: float = 1.0, drain: Callable[[], Awaitable[None]] | None = None,
                                   drain_timeout: float = 0.0) -> None:
        """On SIGTERM: NOT_SERVING at once (probes and routers stop sending), then `drain` (the service refuses
        new work and lets running work end; it bounds itself by drain_timeout), then the server stops. Calls
        still open after the drain get `grace` seconds."""
        await self._stop.wait()
        started = time.monotonic()
        log.info("%s: stopping; draining for up to %.1fs", self.name, drain_timeout)
        await self.health.enter_graceful_shutdown()
        if drain is not None:
            await drain()
        await self.server.stop(grace)
        log.info("%s: drained and stopped in %.2fs", self.name, time.monotonic() - started)


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
