"""`pdserve broker`: the KV-page broker. Every start is a new epoch: nothing from before validates."""
from __future__ import annotations

import argparse
import asyncio
import logging

from ..common import config
from ..common.cli_args import add_service_args
from ..common.proto import broker_pb2, broker_pb2_grpc
from ..common.server import Service, setup_logging
from ..common.tls import add_tls_args, tls_from_args
from ..common.unsafe import check_unsafe
from ..kvtransfer.engine import MOONCAKE_MIN_TIMEOUT_S
from .lease_table import LeaseTable
from .servicer import BrokerServicer

log = logging.getLogger(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=config.BROKER_PORT)
    p.add_argument("--metrics-port", type=int, default=config.METRICS_PORTS["broker"])
    add_service_args(p)
    p.add_argument("--lock-delay", type=float, default=10.0,
                   help="seconds a page stays held after its writer's liveness expired or it acknowledged a failed "
                        "write; must cover the longest a posted write can still land (every prefill checks it, and "
                        f"Mooncake's timeout alone is at least {MOONCAKE_MIN_TIMEOUT_S}s)")
    p.add_argument("--writer-ttl", type=float, default=5.0,
                   help="liveness lease of a writer seen only in BeginWrite, and how long an old-epoch writer may still "
                        "post after a restart (match prefill's --writer-ttl)")
    p.add_argument("--sweep-interval", type=float, default=0.5)
    p.add_argument("--max-ttl", type=float, default=10.0,
                   help="longest liveness lease a holder may ask for, seconds; a decode that moves to another broker "
                        "incarnation waits --reader-ttl + this + --lock-delay before it grants again")
    p.add_argument("--reader-ttl", type=float, default=5.0,
                   help="seconds a decode's pool keeps its leases without a KeepAlive from that decode; then every "
                        "lease of the pool is revoked through quarantine (decode renews every 0.5 s)")
    p.add_argument("--reconcile-grace", type=float, default=15.0,
                   help="seconds after its grant before an owner missing from its decode's KeepAlive is revoked "
                        "(a lost Grant reply, a failed Release); must be >= decode's --rpc-timeout")
    p.add_argument("--heartbeat-interval", type=float, default=0.25,
                   help="seconds between heartbeats on an idle revocation stream; keep well under decode's --max-blind")
    add_tls_args(p)


def check_bounds(args) -> None:
    """Refuses flags under which no writer could ever meet the timing bound, or quarantine would outlast it."""
    problems = []
    if args.lock_delay < MOONCAKE_MIN_TIMEOUT_S:
        problems.append(f"--lock-delay {args.lock_delay}s is under Mooncake's shortest transfer timeout "
                        f"({MOONCAKE_MIN_TIMEOUT_S}s): a failed write may land after its pages were granted again")
    if not 0 < args.sweep_interval < args.lock_delay:
        problems.append(f"--sweep-interval {args.sweep_interval}s must be in (0, --lock-delay {args.lock_delay}s)")
    if not 0 < args.writer_ttl <= args.max_ttl:
        problems.append(f"--writer-ttl {args.writer_ttl}s must be in (0, --max-ttl {args.max_ttl}s]")
    if problems:
        raise SystemExit("broker: refusing to start: " + "; ".join(problems))


async def serve(args) -> None:
    check_unsafe("broker", args)
    check_bounds(args)
    tls = tls_from_args(args, "broker", "broker")
    table = LeaseTable(lock_delay_s=args.lock_delay, default_writer_ttl_s=args.writer_ttl, max_ttl_s=args.max_ttl,
                       reader_ttl_s=args.reader_ttl, reconcile_grace_s=args.reconcile_grace)
    servicer = BrokerServicer(table, heartbeat_s=args.heartbeat_interval)
    svc = Service("broker", [broker_pb2.DESCRIPTOR.services_by_name["Broker"].full_name],
                  args.host, args.port, args.metrics_port, tls=tls, metrics_host=args.metrics_host)
    broker_pb2_grpc.add_BrokerServicer_to_server(servicer, svc.server)
    await svc.start()
    sweeper = asyncio.create_task(servicer.run_sweeper(args.sweep_interval))
    log.info("broker epoch %#x", table.epoch)
    await svc.set_serving()

    async def on_stop() -> None:  # a successor may already be serving: accept nothing new from here on
        servicer.stop_accepting()

    await svc.wait_for_termination(grace=5.0, drain=on_stop)  # the revocation streams get the grace
    sweeper.cancel()


def main(args) -> None:
    setup_logging()
    asyncio.run(serve(args))
