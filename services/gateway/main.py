"""`pdserve gateway`: the public gRPC API in front of the prefill and decode instances it discovers."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os

from grpc_health.v1 import health_pb2

from ..common import config
from ..common.cli_args import MODEL_HELP, add_service_args
from ..common.errors import PdError
from ..common.hub import ModelNotFound, ModelRef, resolve_model
from ..common.metrics import init_metrics, track_load
from ..common.proto import gateway_pb2, gateway_pb2_grpc
from ..common.server import Service, setup_logging
from ..common.tls import add_tls_args, tls_from_args
from ..common.unsafe import check_unsafe
from ..engine.chat import ChatTemplate, ChatTemplateError
from ..engine.config import ModelConfig
from ..engine.grammar import Grammars
from ..engine.tokenizer import load_tokenizer
from ..common.drain import settle
from .api_key import ApiKeyInterceptor
from .backends import Backends
from .discovery import Discovery
from .drain import drain
from .exposure import add_exposure_args, check_exposure
from .limits import DEFAULT_MAX_CONCURRENT, ConcurrencyLimit
from .openai.app import Front, create_app
from .openai.server import HttpServer, add_http_args, api_keys, http_limits
from .request_size import request_limit
from .scope import add_prefix_args, scoping_from_args
from .servicer import Capacity, GatewayServicer

log = logging.getLogger(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=config.GATEWAY_PORT)
    p.add_argument("--http-port", type=int, default=config.GATEWAY_HTTP_PORT,
                   help="OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
                        "/health); -1 disables it")
    add_http_args(p)
    add_exposure_args(p)
    p.add_argument("--metrics-port", type=int, default=config.METRICS_PORTS["gateway"])
    add_service_args(p)
    p.add_argument("--prefill", action="append", default=None, help="prefill HOST:PORT (repeatable)")
    p.add_argument("--decode", action="append", default=None, help="decode HOST:PORT (repeatable)")
    p.add_argument("--prefill-discovery", action="append", default=None, metavar="SPEC",
                   help="prefill instances to follow: dns:NAME:PORT (every A/AAAA record, e.g. a headless Service) "
                        "or file:PATH (HOST:PORT per line); repeatable, combines with --prefill")
    p.add_argument("--decode-discovery", action="append", default=None, metavar="SPEC",
                   help="decode instances to follow, as --prefill-discovery")
    p.add_argument("--discovery-interval", type=float, default=1.0, help="seconds between two DNS/file looks")
    p.add_argument("--load-interval", type=float, default=0.5, help="seconds between two GetInfo polls of a backend")
    p.add_argument("--model", default=config.DEFAULT_MODEL, help=f"the checkpoint whose tokenizer and chat template "
                   f"the gateway uses: {MODEL_HELP}")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name(s) in the OpenAI API: a request may name any of them, /v1/models lists them "
                        "all, responses report the first (default: --model as given when a Hugging Face id, else the "
                        "checkpoint directory's name)")
    p.add_argument("--byte-tokenizer", action="store_true",
                   help="encode text as UTF-8 bytes (ids 0..255) instead of the checkpoint's tokenizer.json")
    p.add_argument("--max-concurrent-requests", type=int, default=DEFAULT_MAX_CONCURRENT,
                   help="Generate calls (gRPC and HTTP choices together) running at once; one more is refused at "
                        "once with RESOURCE_EXHAUSTED OVERLOADED (HTTP 429) and a retry delay; 0: no limit")
    p.add_argument("--context-length", type=int, default=0,
                   help="the context the prefill and decode instances serve, when they are given one past the "
                        "checkpoint's (their --context-length): sizes the public gRPC port's receive limit (default "
                        "0: the checkpoint's). Admission still takes the context the backends report")
    p.add_argument("--max-request-bytes", type=int, default=0,
                   help="the public gRPC port's receive limit: a larger request is refused RESOURCE_EXHAUSTED before "
                        "it is parsed (default 0: the largest legal request, from the checkpoint's context length "
                        "and the field limits, logged at start-up)")
    p.add_argument("--prefill-timeout", type=float, default=60.0,
                   help="bound on one Prefill call, seconds, plus --prefill-timeout-per-token per prompt token")
    p.add_argument("--prefill-timeout-per-token", type=float, default=0.005,
                   help="seconds the Prefill bound (and the wait for the first token) grows per prompt token: "
                        "a long prompt's forward pass is not cut off by a bound sized for short ones")
    p.add_argument("--token-timeout", type=float, default=60.0, help="bound on the gap between two tokens, seconds")
    p.add_argument("--max-resubmissions", type=int, default=3,
                   help="times a request decode preempted (its KV pool ran dry) is resubmitted as prompt + the "
                        "tokens streamed, continuing the client's stream; past it the client gets PREEMPTED")
    p.add_argument("--write-notice-timeout", type=float, default=5.0,
                   help="seconds between prefill reporting the KV written and decode's first token (the broker's "
                        "write-done notice) before the request fails UNAVAILABLE, retryable")
    p.add_argument("--drain-timeout", type=float, default=25.0,
                   help="on SIGTERM, seconds running streams get to finish while new requests are refused "
                        "UNAVAILABLE (DRAINING); keep under the pod's terminationGracePeriodSeconds")
    add_prefix_args(p)
    add_tls_args(p, "the gateway's channels to prefill and decode (its public gRPC and HTTP APIs stay plaintext)")


def served_names(given: list[str] | None, model: ModelRef) -> tuple[str, ...]:
    """--served-model-name, checked, else the model's own name."""
    if given is None:
        return (model.name,)
    empty = [i for i, n in enumerate(given) if not n.strip()]
    if empty:
        raise SystemExit(f"gateway: --served-model-name: name {empty[0] + 1} of {len(given)} is empty")
    twice = sorted({n for n in given if given.count(n) > 1})
    if twice:
        raise SystemExit(f"gateway: --served-model-name: {', '.join(twice)} given more than once")
    return tuple(given)


def log_prompt_bound(tokenizer) -> None:
    if tokenizer.max_chars_per_token is None:
        log.warning("gateway: no bound on characters per token (%s): every text prompt is tokenized in full before "
                    "its length is checked", tokenizer.no_bound_reason)
    else:
        log.info("gateway: no token spans more than %d characters: a text prompt longer than that many times the "
                 "admissible tokens is refused without tokenizing it", tokenizer.max_chars_per_token)


def capacity_of(infos: dict[str, list]) -> Capacity:
    """Admission limits over the backends that take work now; every one agrees on model and layout
    (backends.py refuses the others), so only the sizes differ."""
    prefills, decodes = infos["prefill"], infos["decode"]
    i0 = (prefills + decodes)[0]
    return Capacity(model=i0.model, context_length=min(i.context_length for i in prefills + decodes),
                    vocab_size=i0.vocab_size, page_size=i0.page_size,
                    decode_pool_pages=min(i.pool_pages for i in decodes),
                    prefill_pool_tokens=min(i.pool_pages * i.page_size for i in prefills))


def discoveries(args, backends: Backends) -> list[Discovery]:
    out = []
    for role, port in (("prefill", config.PREFILL_PORT), ("decode", config.DECODE_PORT)):
        static, specs = getattr(args, role) or [], getattr(args, f"{role}_discovery") or []
        if not static and not specs:
            static = [f"127.0.0.1:{port}"]
        try:
            out.append(Discovery(role, static, specs, lambda t, d, role=role: backends.update(role, t, d),
                                 args.discovery_interval))
        except ValueError as e:
            raise SystemExit(f"gateway: --{role}/--{role}-discovery: {e}") from None
    return out


class Health:
    """SERVING while at least one prefill and one decode take work, NOT_SERVING otherwise; follows the
    backends without a restart. The first time it serves, it prints the ready line."""

    def __init__(self, svc: Service, servicer: GatewayServicer, backends: Backends, request_limit=None):
        self.svc, self.servicer, self.backends = svc, servicer, backends
        self.request_limit = request_limit
        self.changed = asyncio.Event()
        self.first = asyncio.Event()
        self.serving = False
        self.printed = False

    def on_change(self) -> None:
        infos = self.backends.capacity_infos()
        if all(infos.values()):
            cap = capacity_of(infos)
            if cap != self.servicer.cap:
                log.info("gateway: capacity over %d prefill and %d decode: context %d, decode pool %d pages, "
                         "prefill pool %d tokens", len(infos["prefill"]), len(infos["decode"]), cap.context_length,
                         cap.decode_pool_pages, cap.prefill_pool_tokens)
                self.servicer.cap = cap
                if self.request_limit is not None:
                    self.request_limit.check_context(cap.context_length)
            self.first.set()
        self.changed.set()

    async def run(self) -> None:
        while True:
            await self.changed.wait()
            self.changed.clear()
            want = self.backends.is_usable() and self.servicer.tokenizer is not None and \
                not self.servicer.draining
            if want == self.serving:
                continue
            self.serving = want
            if want and not self.printed:
                self.printed = True
                await self.svc.set_serving()
                continue
            status = health_pb2.HealthCheckResponse.SERVING if want else health_pb2.HealthCheckResponse.NOT_SERVING
            log.log(logging.INFO if want else logging.WARNING, "gateway: %s (prefill %d, decode %d take work)",
                    "SERVING" if want else "NOT_SERVING", len(self.backends.routers["prefill"].backends),
                    len(self.backends.routers["decode"].backends))
            for name in ["", *self.svc.full_service_names]:
                await self.svc.health.set(name, status)


def _eos_ids(model_dir: str) -> tuple[int, ...]:
    """The checkpoint's end-of-sequence ids for the grammar (what prefill and decode give theirs); a gateway given
    only the tokenizer files lets the grammar library find them in tokenizer.json."""
    try:
        return ModelConfig.from_dir(model_dir).eos_token_ids
    except (OSError, ValueError) as e:
        log.info("structured output: no end-of-sequence ids from %s (%s); the tokenizer's own are used", model_dir, e)
        return ()


async def serve(args) -> None:
    check_unsafe("gateway", args)
    limits, keys, scoping = http_limits(args), api_keys(args), scoping_from_args(args)
    check_exposure(args.host, args.port, args.http_port, keys, args.allow_unauthenticated)
    tls = tls_from_args(args, "gateway", "gateway")
    try:
        concurrency = ConcurrencyLimit(args.max_concurrent_requests)
    except ValueError as e:
        raise SystemExit(f"gateway: --max-concurrent-requests: {e}") from None
    try:
        model = resolve_model(args.model)
    except ModelNotFound as e:
        raise SystemExit(f"gateway: {e}") from None
    names = served_names(args.served_model_name, model)
    # the checkpoint's tokenizer and chat template are read before any backend is looked for: a missing or broken
    # one stops the gateway at once with its message (the byte tokenizer needs the vocabulary size, found later)
    tokenizer = None if args.byte_tokenizer else load_tokenizer(model.path, 0)
    if tokenizer is not None:
        log_prompt_bound(tokenizer)
    receive = request_limit(args.max_request_bytes, model.path, tokenizer, args.context_length)
    template = None
    if args.http_port >= 0:
        try:
            template = ChatTemplate.from_dir(model.path)
        except ChatTemplateError as e:
            raise SystemExit(f"gateway: {model.path}: {e}") from None
    init_metrics("gateway")
    backends = Backends(tls, args.load_interval, max_load_gap=args.prefix_route_max_load_gap,
                        prefix_entries=args.prefix_route_entries)
    servicer = GatewayServicer(backends.routers["prefill"], backends.routers["decode"], None, None,
                               args.prefill_timeout, args.token_timeout, args.write_notice_timeout,
                               args.max_resubmissions, args.prefill_timeout_per_token, keys, scoping)
    log.info("gateway: prefix cache %s%s", "on, scope " + scoping.scope if scoping.enabled else "off",
             f", routed by prefix within a load gap of {args.prefix_route_max_load_gap}" if scoping.enabled else "")
    servicer.concurrency = concurrency
    track_load("gateway", servicer.load)
    svc = Service("gateway", [gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name],
                  args.host, args.port, args.metrics_port, tls=None,  # public API: plaintext by design
                  metrics_host=args.metrics_host, guards=(ApiKeyInterceptor(keys),) if keys is not None else (),
                  max_receive_bytes=receive.max_bytes)
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, svc.server)
    health = Health(svc, servicer, backends, receive)
    backends.on_change = health.on_change
    await svc.start()  # NOT_SERVING until discovery has found a prefill and a decode that agree
    # loops that end only when cancelled below: plain tasks, not spawned give-backs (which the drain waits for)
    tasks = [asyncio.ensure_future(d.run()) for d in discoveries(args, backends)]
    await svc.starting(health.first.wait())  # a SIGTERM before any backend answered exits at once
    cap = servicer.cap
    if tokenizer is None:
        tokenizer = load_tokenizer(model.path, cap.vocab_size, byte_tokenizer=True)
        log_prompt_bound(tokenizer)
    servicer.tokenizer = tokenizer
    if not args.byte_tokenizer:  # structured output compiles against the tokenizer prefill and decode use
        servicer.grammars = Grammars(os.path.join(model.path, "tokenizer.json"), cap.vocab_size, _eos_ids(model.path))
    http = None
    if args.http_port >= 0:
        front = Front(servicer, names, limits, template)
        log.info("gateway: the OpenAI API serves %s as %s", model.given, ", ".join(names))
        http = HttpServer(create_app(front, keys), args.host, args.http_port, front.limits,
                          args.drain_timeout)
        args.http_port = await http.start()
        print(f"PDSERVE_HTTP port={args.http_port}", flush=True)
    tasks.append(asyncio.ensure_future(health.run()))
    health.changed.set()
    await svc.wait_for_termination(drain=lambda: drain(servicer, args.drain_timeout), drain_timeout=args.drain_timeout)
    if http is not None:
        await http.close()
    await settle(2.0)  # the Release of a stream cancelled at the drain timeout
    for t in tasks:
        t.cancel()
    await backends.close()


def main(args) -> None:
    setup_logging()
    try:
        asyncio.run(serve(args))
    except PdError as e:
        raise SystemExit(f"gateway: {e}") from None
