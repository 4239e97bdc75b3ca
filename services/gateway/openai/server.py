"""uvicorn inside the gateway's event loop, beside the gRPC server. uvicorn's own `serve()` would install
its signal handlers over the gateway's (whose SIGTERM drain must keep working), so the server is started and
stopped piecewise. The h11 protocol gets the limits uvicorn lacks: a connection limit, and a bound on the
time to send a request's head (an idle or slow-loris connection is closed, not kept forever)."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import logging
import os
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ...common.admission import MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_STRINGS
from ...engine.grammar import MAX_SCHEMA_BYTES
from ..keys import ApiKeys, KeysFileError
from .completions import MAX_CHOICES
from .errors import ApiError

log = logging.getLogger(__name__)
OTHER_FIELDS_BYTES = 64 << 10  # a request's scalar fields, names and the keys of its messages
ESCAPED_CHAR_BYTES = 12  # the longest JSON spelling of one character: a surrogate pair, \ud83d\ude00


@dataclass(slots=True)
class Limits:
    max_body_bytes: int | None = None  # None: largest_request_bytes of the model served, once it is known
    max_header_bytes: int = 64 << 10
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1024
    keep_alive_s: float = 5.0


def largest_request_bytes(context_length: int, vocab_size: int, max_chars_per_token: int | None) -> int:
    """The default body limit: the largest legal request, written compactly. Its prompts: MAX_CHOICES of
    context_length token ids each (", " between ids), or one context of text whose every token is the tokenizer's
    longest (max_chars_per_token characters of up to 4 UTF-8 bytes), whichever is more. Beside them, the most the
    other fields carry: two JSON schemas (response_format, or tools forced through the grammar), a full logit_bias,
    the stop strings escaped, and room for the scalar fields and messages' keys. More text than that (a batch of
    such prompts, or \\u-escaped) is legal but over the default: send token ids, or set --http-max-body-bytes."""
    ids = MAX_CHOICES * (len(str(vocab_size - 1)) + 2)
    text = 4 * (max_chars_per_token or 0)
    schemas = 2 * MAX_SCHEMA_BYTES
    bias = MAX_LOGIT_BIAS * len(f'"{vocab_size - 1}": -100.00000000000001, ')
    stops = MAX_STOP_STRINGS * MAX_STOP_CHARS * ESCAPED_CHAR_BYTES
    return context_length * max(ids, text) + schemas + bias + stops + OTHER_FIELDS_BYTES


class _HeadCork:
    """A response cycle's transport: its first write (the response head) is held until its next write or the end of
    this event-loop turn, whichever comes first, so that the head and the first chunk of a stream go out in one
    send: one segment, one wake-up of the client on the first token's path. Bytes and their order are unchanged."""

    __slots__ = ("_transport", "_loop", "_held", "_armed")

    def __init__(self, transport, loop):
        self._transport, self._loop = transport, loop
        self._held: bytes | None = None
        self._armed = True

    def write(self, data) -> None:
        if self._armed:
            self._armed = False
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
            return
        if self._held is not None:
            data, self._held = self._held + data, None
        self._transport.write(data)

    def flush(self) -> None:
        if self._held is not None:
            data, self._held = self._held, None
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name):
        return getattr(self._transport, name)


class LimitedH11(H11Protocol):
    def __init__(self, *args, limits: Limits, **kw):
        super().__init__(*args, **kw)
        self.limits = limits
        self._head_timer: asyncio.TimerHandle | None = None
        self._cycle = None

    def connection_made(self, transport) -> None:
        if len(self.connections) >= self.limits.max_connections:
            log.warning("http: %d connections open (limit %d); closing a new one", len(self.connections),
                        self.limits.max_connections)
            transport.abort()
            return
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        if not self.transport.is_closing():
            log.info("http: no complete request head within %.1fs from %s; closing", self.limits.header_timeout_s,
                     self.client)
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not self._cycle:  # a new request's head is complete: the body has its own bound
            self._cycle = self.cycle
            self._disarm()
            if self.cycle is not None:  # its task has not run yet: nothing was written through the plain transport
                self.cycle.transport = _HeadCork(self.transport, self.loop)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.cycle is self._cycle:
            self._arm()  # the next request's head is bounded too (the keep-alive timer stops at its first byte)

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self.transport is not None:  # None: refused by the connection limit, never registered
            super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (a head over the size limit, a malformed line): the error object, then
        the connection is closed."""
        err = ApiError(400, "bad_http_request", f"invalid HTTP request (malformed, or a head over "
                                                f"{self.limits.max_header_bytes} bytes)")
        data = json.dumps(err.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(data)).encode())]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers)))
            self.transport.write(self.conn.send(h11.Data(data=data)) + self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:
            pass  # a response had already begun on this connection: closing is all that is left
        self.transport.close()


class HttpServer:
    def __init__(self, app, host: str, port: int, limits: Limits, drain_timeout_s: float):
        self.config = uvicorn.Config(
            app, host=host, port=port, http=functools.partial(LimitedH11, limits=limits), lifespan="off",
            timeout_keep_alive=limits.keep_alive_s, h11_max_incomplete_event_size=limits.max_header_bytes,
            timeout_graceful_shutdown=drain_timeout_s, access_log=False, log_config=None, log_level="warning",
            server_header=False)  # log_config=None: uvicorn logs through the gateway's own handlers
        self.server = uvicorn.Server(self.config)
        self._ticks: asyncio.Task | None = None

    async def start(self) -> int:
        self.config.load()
        self.server.lifespan = self.config.lifespan_class(self.config)
        await self.server.startup()
        self._ticks = asyncio.ensure_future(self.server.main_loop())  # the Date header, once a second
        return self.server.servers[0].sockets[0].getsockname()[1]

    async def close(self) -> None:
        """After the gateway's drain: running responses get the graceful timeout, then are cancelled."""
        self.server.should_exit = True
        if self._ticks is not None:
            await self._ticks
        await self.server.shutdown()


def add_http_args(p: argparse.ArgumentParser) -> None:
    d = Limits()
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on the HTTP API except /health, and as gRPC metadata "
                        "`authorization: Bearer KEY` on the gRPC API except health and reflection; its tenant is "
                        "`default`; default: env PDSERVE_API_KEY, else no key")
    p.add_argument("--api-keys-file", default=None, metavar="PATH",
                   help="API keys and their tenants, one `TENANT: KEY` a line (# comments); each request is of its "
                        "key's tenant (prefix caching never shares KV across tenants unless --prefix-cache-scope "
                        "global); replaces --api-key and PDSERVE_API_KEY")
    p.add_argument("--http-max-body-bytes", type=int, default=d.max_body_bytes,
                   help="largest request body, counted as it arrives (Content-Length or chunked); larger: 413. "
                        "Default: the largest legal request of the model served, written compactly (64 prompts "
                        "of a full context of token ids, or one context of text at the tokenizer's longest token, "
                        "plus two JSON schemas, logit_bias and stop strings), logged at start")
    p.add_argument("--http-max-header-bytes", type=int, default=d.max_header_bytes,
                   help="largest request line + headers; larger: 400 and the connection is closed")
    p.add_argument("--http-header-timeout", type=float, default=d.header_timeout_s,
                   help="seconds a connection gets to send a complete request head, then it is closed")
    p.add_argument("--http-body-timeout", type=float, default=d.body_timeout_s,
                   help="seconds a request gets to send its whole body; slower: 408")
    p.add_argument("--http-max-connections", type=int, default=d.max_connections,
                   help="open HTTP connections; one more is closed at once")
    p.add_argument("--http-keep-alive", type=float, default=d.keep_alive_s,
                   help="seconds an idle keep-alive connection is kept")


def http_limits(args) -> Limits:
    limits = Limits(args.http_max_body_bytes, args.http_max_header_bytes, args.http_header_timeout,
                    args.http_body_timeout, args.http_max_connections, args.http_keep_alive)
    bad = {f.name: v for f in dataclasses.fields(limits) if (v := getattr(limits, f.name)) is not None and not v > 0}
    if bad:
        raise SystemExit(f"gateway: HTTP limits must be > 0, got {bad}")
    return limits


def api_keys(args) -> ApiKeys | None:
    """--api-keys-file, else --api-key, else PDSERVE_API_KEY (one key, tenant `default`); an empty key is refused
    (it would read as "no key")."""
    if args.api_keys_file is not None:
        if args.api_key is not None:
            raise SystemExit("gateway: --api-key and --api-keys-file both given; put the key in the file")
        if os.environ.get("PDSERVE_API_KEY"):
            log.warning("gateway: PDSERVE_API_KEY is ignored: --api-keys-file %s decides the keys", args.api_keys_file)
        try:
            keys = ApiKeys.from_file(args.api_keys_file)
        except KeysFileError as e:
            raise SystemExit(f"gateway: --api-keys-file {e}") from None
        log.info("gateway: API keys of %d tenant(s) from %s", len(keys.tenants), args.api_keys_file)
        return keys
    key = args.api_key if args.api_key is not None else os.environ.get("PDSERVE_API_KEY")
    if key is not None and not key.strip():
        raise SystemExit("gateway: the API key (--api-key or PDSERVE_API_KEY) is empty")
    return None if key is None else ApiKeys.single(key)
