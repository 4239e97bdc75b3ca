"""`pdserve prefill`: one prefill instance."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets

from ..common import config
from ..common.capacity import check_pool_capacity
from ..common.cli_args import add_engine_args
from ..common.metrics import init_metrics
from ..common.proto import broker_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from ..common.server import GRPC_OPTIONS, Service, setup_logging
from ..common.tls import own_identity, secure_channel, tls_from_args
from ..engine.runner import ModelRunner, set_threads
from ..kvtransfer.engine import TransferEngine
from .servicer import PrefillServicer
from .worker import PrefillWorker

log = logging.getLogger(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p, "prefill", config.PREFILL_PORT, config.DEFAULT_PREFILL_POOL_TOKENS)
    p.add_argument("--writer-ttl", type=float, default=5.0, help="liveness lease of one write, seconds")
    p.add_argument("--transfer-timeout", type=float, default=30.0, help="bound on one request's KV transfer")


async def serve(args) -> None:
    tls = tls_from_args(args, "prefill", "prefill")
    num_pages = args.pool_tokens // args.page_size
    set_threads(args.threads, args.switch_interval_ms)
    runner = ModelRunner(args.model, num_pages, args.page_size, args.kv_dtype, args.device)
    context_length = args.context_length or runner.config.max_position_embeddings
    pool_name = f"prefill-{args.port}"
    init_metrics("prefill", [pool_name])
    max_prompt = check_pool_capacity("prefill", pool_name, num_pages * args.page_size, context_length,
                                     args.allow_pool_smaller_than_context)
    transfer = TransferEngine(args.host, args.protocol)
    worker = PrefillWorker(runner, transfer, checksums=not args.no_transfer_checksum)
    channel = secure_channel(args.broker, tls, GRPC_OPTIONS)
    broker = broker_pb2_grpc.BrokerStub(channel)
    # the broker lets a prefill name only writer ids under its own identity
    writer_id = f"{own_identity(tls, 'prefill')}/{os.getpid()}-{secrets.token_hex(4)}"
    svc = Service("prefill", [prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name],
                  args.host, args.port, args.metrics_port, tls=tls)
    prefill_pb2_grpc.add_PrefillServicer_to_server(
        PrefillServicer(worker, broker, writer_id, context_length, max_prompt,
                        os.path.basename(os.path.normpath(args.model)), writer_ttl_s=args.writer_ttl,
                        transfer_timeout_s=args.transfer_timeout), svc.server)
    await svc.start()
    await svc.set_serving()
    await svc.wait_for_termination()


def main(args) -> None:
    setup_logging()
    asyncio.run(serve(args))
