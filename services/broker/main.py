"""`pdserve broker`: the KV-page broker. Every start is a new epoch: nothing from before validates."""
from __future__ import annotations

import argparse
import asyncio
import logging

from ..common import config
from ..common.proto import broker_pb2, broker_pb2_grpc
from ..common.server import Service, setup_logging
from .lease_table import LeaseTable
from .servicer import BrokerServicer

log = logging.getLogger(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=config.BROKER_PORT)
    p.add_argument("--metrics-port", type=int, default=config.METRICS_PORTS["broker"])
    p.add_argument("--lock-delay", type=float, default=2.0,
                   help="seconds a dead writer's pages stay quarantined after its liveness lease expires; "
                        "must exceed the transport's longest retry/timeout")
    p.add_argument("--writer-ttl", type=float, default=5.0,
                   help="liveness lease of a writer seen only in BeginWrite, and how long an old-epoch writer may still "
                        "post after a restart (match prefill's --writer-ttl)")
    p.add_argument("--sweep-interval", type=float, default=0.5)
    p.add_argument("--reader-ttl", type=float, default=5.0,
                   help="seconds a decode's pool keeps its leases without a KeepAlive from that decode; then every "
                        "lease of the pool is revoked through quarantine (decode renews every 0.5 s)")
    p.add_argument("--reconcile-grace", type=float, default=15.0,
                   help="seconds after its grant before an owner missing from its decode's KeepAlive is revoked "
                        "(a lost Grant reply, a failed Release); must be >= decode's --rpc-timeout")
    p.add_argument("--heartbeat-interval", type=float, default=0.25,
                   help="seconds between heartbeats on an idle revocation stream; keep well under decode's --max-blind")


async def serve(args) -> None:
    table = LeaseTable(lock_delay_s=args.lock_delay, default_writer_ttl_s=args.writer_ttl,
                       reader_ttl_s=args.reader_ttl, reconcile_grace_s=args.reconcile_grace)
    servicer = BrokerServicer(table, heartbeat_s=args.heartbeat_interval)
    svc = Service("broker", [broker_pb2.DESCRIPTOR.services_by_name["Broker"].full_name],
                  args.host, args.port, args.metrics_port)
    broker_pb2_grpc.add_BrokerServicer_to_server(servicer, svc.server)
    await svc.start()
    sweeper = asyncio.create_task(servicer.run_sweeper(args.sweep_interval))
    log.info("broker epoch %#x", table.epoch)
    await svc.set_serving()
    await svc.wait_for_termination()
    sweeper.cancel()


def main(args) -> None:
    setup_logging()
    asyncio.run(serve(args))
