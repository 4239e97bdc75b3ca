"""`pdserve gateway`: the public gRPC API in front of prefill and decode instances."""
from __future__ import annotations

import argparse
import asyncio
import logging

import grpc

from ..common import config
from ..common.cli_args import add_service_args
from ..common.errors import PdError
from ..common.metrics import init_metrics
from ..common.proto import common_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc, prefill_pb2_grpc
from ..common.server import GRPC_OPTIONS, Service, setup_logging
from ..common.tls import add_tls_args, secure_channel, tls_from_args
from ..common.unsafe import check_unsafe
from ..engine.tokenizer import load_tokenizer
from ..common.drain import settle
from .drain import drain
from .router import Backend
from .http import start_http
from .servicer import Capacity, GatewayServicer

log = logging.getLogger(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=config.GATEWAY_PORT)
    p.add_argument("--http-port", type=int, default=config.GATEWAY_HTTP_PORT,
                   help="OpenAI-compatible HTTP API (POST /v1/completions); -1 disables it")
    p.add_argument("--metrics-port", type=int, default=config.METRICS_PORTS["gateway"])
    add_service_args(p)
    p.add_argument("--prefill", action="append", default=None, help="prefill HOST:PORT (repeatable)")
    p.add_argument("--decode", action="append", default=None, help="decode HOST:PORT (repeatable)")
    p.add_argument("--model", default=config.DEFAULT_MODEL, help="checkpoint directory (for the tokenizer)")
    p.add_argument("--queue-limit", type=int, default=256)
    p.add_argument("--queue-timeout", type=float, default=30.0, help="bound on waiting for free KV pages, seconds")
    p.add_argument("--prefill-timeout", type=float, default=60.0, help="bound on one Prefill call, seconds")
    p.add_argument("--token-timeout", type=float, default=60.0, help="bound on the gap between two tokens, seconds")
    p.add_argument("--drain-timeout", type=float, default=25.0,
                   help="on SIGTERM, seconds running streams get to finish while new requests are refused "
                        "UNAVAILABLE (DRAINING); keep under the pod's terminationGracePeriodSeconds")
    add_tls_args(p, "the gateway's channels to prefill and decode (its public gRPC and HTTP APIs stay plaintext)")


async def _info(target: str, stub, timeout: float = 120.0) -> common_pb2.EngineInfo:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            return await stub.GetInfo(common_pb2.GetInfoRequest(), timeout=5)
        except grpc.RpcError as e:
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"{target} did not answer GetInfo within {timeout:.0f}s: {e.code()}") from None
            await asyncio.sleep(0.2)


def capacity_of(prefills: list[Backend], decodes: list[Backend]) -> Capacity:
    infos = [b.info for b in prefills + decodes]
    keys = {(i.model, i.vocab_size, i.page_size, i.layout.SerializeToString()) for i in infos}
    if len(keys) != 1:
        raise SystemExit(f"gateway: prefill and decode instances disagree on model/vocab/page layout: {keys}")
    i0 = infos[0]
    return Capacity(model=i0.model, context_length=min(i.context_length for i in infos), vocab_size=i0.vocab_size,
                    page_size=i0.page_size, decode_pool_pages=min(b.info.pool_pages for b in decodes),
                    prefill_pool_tokens=min(b.info.pool_pages * b.info.page_size for b in prefills))


async def serve(args) -> None:
    check_unsafe("gateway", args)
    tls = tls_from_args(args, "gateway", "gateway")
    init_metrics("gateway")
    # listening at once: probes see NOT_SERVING (alive, not ready) while the backends are still starting
    svc = Service("gateway", [gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name],
                  args.host, args.port, args.metrics_port, tls=None,  # public API: plaintext by design
                  metrics_host=args.metrics_host)
    holder = svc.hold(gateway_pb2_grpc.add_GatewayServicer_to_server,
                      gateway_pb2.DESCRIPTOR.services_by_name["Gateway"])
    await svc.start()
    servicer = await svc.starting(_start(args, tls))
    holder.servicer = servicer
    http = None
    if args.http_port >= 0:
        http = await start_http(servicer, servicer.cap.model, args.host, args.http_port)
        args.http_port = http.sockets[0].getsockname()[1]
        print(f"PDSERVE_HTTP port={args.http_port}", flush=True)
    await svc.set_serving()
    await svc.wait_for_termination(drain=lambda: drain(servicer, args.drain_timeout), drain_timeout=args.drain_timeout)
    if http is not None:
        http.close()
    await settle(2.0)  # the Release of a stream cancelled at the drain timeout


async def _start(args, tls) -> GatewayServicer:
    prefill_targets = args.prefill or [f"127.0.0.1:{config.PREFILL_PORT}"]
    decode_targets = args.decode or [f"127.0.0.1:{config.DECODE_PORT}"]
    prefills = [Backend(t, prefill_pb2_grpc.PrefillStub(secure_channel(t, tls, GRPC_OPTIONS)))
                for t in prefill_targets]
    decodes = [Backend(t, decode_pb2_grpc.DecodeStub(secure_channel(t, tls, GRPC_OPTIONS)))
               for t in decode_targets]
    for b in prefills + decodes:
        b.info = await _info(b.target, b.stub)
    cap = capacity_of(prefills, decodes)
    tokenizer = load_tokenizer(args.model, cap.vocab_size)
    log.info("gateway: model %s, context %d, decode pool %d pages, prefill pool %d tokens", cap.model,
             cap.context_length, cap.decode_pool_pages, cap.prefill_pool_tokens)
    return GatewayServicer(prefills, decodes, tokenizer, cap, args.queue_limit, args.queue_timeout,
                           args.prefill_timeout, args.token_timeout)


def main(args) -> None:
    setup_logging()
    try:
        asyncio.run(serve(args))
    except PdError as e:
        raise SystemExit(f"gateway: {e}") from None
