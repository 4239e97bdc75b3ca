"""`pdserve broker`: the KV-page broker. Every start is a new epoch: nothing from before validates. With --etcd,
one replica of several: it answers only while it leads its election's term, from a lease table of that term alone
(docs/design.md §3, "Leader failover"); once the term is over it drops the table and follows with a fresh one."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket

from ..common import config
from ..common.cli_args import add_service_args
from ..common.proto import broker_pb2, broker_pb2_grpc
from ..common.server import Service, setup_logging
from ..common.tls import add_tls_args, own_identity, tls_from_args
from ..common.unsafe import check_unsafe
from ..kvtransfer.engine import MOONCAKE_MIN_TIMEOUT_S
from .authority import ElectedAuthority, SoleAuthority
from .election import RETRYABLE, Election, NotLeaderError, connect, election_key
from .free_set import DurableFreeSet
from .lease_table import LeaseTable
from .leadership import LeadershipCollector, lead_one_term, shared_epoch
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
    ha = p.add_argument_group("leader election (several replicas)")
    ha.add_argument("--etcd", default="", metavar="HOST:PORT[,HOST:PORT...]",
                    help="etcd endpoints: run as one replica of several, answering only while it leads")
    ha.add_argument("--cluster", default="pdserve", help="the election's name in etcd: replicas of one broker share it")
    ha.add_argument("--election-ttl", type=int, default=5,
                    help="etcd lease of the leader, whole seconds: a dead leader is replaced after at most this; "
                         "too short for a loaded host fails over for nothing")
    ha.add_argument("--election-margin", type=float, default=1.0,
                    help="seconds the leader's authority ends before its etcd lease can expire (clock-rate and "
                         "scheduling slack); must be under --election-ttl")
    ha.add_argument("--advertise", default="", help="the address clients reach this replica at (default HOST:PORT)")
    ha.add_argument("--etcd-ca", default="", help="PEM CA etcd's certificates are signed by: etcd over mutual TLS, "
                                                  "with --etcd-cert and --etcd-key (default: plaintext)")
    ha.add_argument("--etcd-cert", default="", help="PEM client certificate this replica presents to etcd")
    ha.add_argument("--etcd-key", default="", help="PEM key of --etcd-cert")
    ha.add_argument("--etcd-server-name", default="", help="the name etcd's certificate carries, when the "
                                                           "endpoints are addresses it does not name")
    add_tls_args(p)


def etcd_credentials(args):
    """Mutual TLS to etcd from --etcd-ca/--etcd-cert/--etcd-key: all three, or none (plaintext, a local etcd)."""
    given = [args.etcd_ca, args.etcd_cert, args.etcd_key]
    if not any(given):
        return None
    if not all(given):
        raise SystemExit("broker: refusing to start: --etcd-ca, --etcd-cert and --etcd-key go together "
                         f"(given: {', '.join(n for n, v in zip(('--etcd-ca', '--etcd-cert', '--etcd-key'), given) if v)})")
    import grpc

    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()
    return grpc.ssl_channel_credentials(read(args.etcd_ca), read(args.etcd_key), read(args.etcd_cert))


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
    if args.etcd and not 0 < args.election_margin < args.election_ttl:
        problems.append(f"--election-margin {args.election_margin}s must be in (0, --election-ttl "
                        f"{args.election_ttl}s)")
    if problems:
        raise SystemExit("broker: refusing to start: " + "; ".join(problems))


async def serve(args) -> None:
    check_unsafe("broker", args)
    check_bounds(args)
    tls = tls_from_args(args, "broker", "broker")
    def new_table() -> LeaseTable:
        return LeaseTable(lock_delay_s=args.lock_delay, default_writer_ttl_s=args.writer_ttl, max_ttl_s=args.max_ttl,
                          reader_ttl_s=args.reader_ttl, reconcile_grace_s=args.reconcile_grace)
    table = new_table()
    svc = Service("broker", [broker_pb2.DESCRIPTOR.services_by_name["Broker"].full_name],
                  args.host, args.port, args.metrics_port, tls=tls, metrics_host=args.metrics_host)
    election = None
    if args.etcd:
        identity = f"{own_identity(tls, 'broker')}@{socket.gethostname()}-{os.getpid()}"
        election = Election(connect(args.etcd.split(","), credentials=etcd_credentials(args),
                                    server_name=args.etcd_server_name or None), election_key(args.cluster), identity,
                            args.advertise or f"{args.host}:{svc.port}", args.election_ttl, args.election_margin)
    authority = ElectedAuthority(election) if election else SoleAuthority()
    collector = LeadershipCollector(authority)
    free_set = DurableFreeSet(election, args.cluster, table) if election else None
    servicer = BrokerServicer(table, heartbeat_s=args.heartbeat_interval, authority=authority, free_set=free_set)
    broker_pb2_grpc.add_BrokerServicer_to_server(servicer, svc.server)
    await svc.start()
    sweeper = asyncio.create_task(servicer.run_sweeper(args.sweep_interval))
    log.info("broker epoch %#x", table.epoch)
    role = None
    if election is None:
        await svc.set_serving()
    else:
        election.start()
        await svc.set_serving(healthy=False)  # a standby answers health, NOT_SERVING, until it leads
        role = asyncio.create_task(replica_life(args, svc, election, servicer, collector, new_table,
                                                (table, authority, free_set)))

    async def on_stop() -> None:  # a successor may already be serving: accept nothing new from here on
        servicer.stop_accepting()
        if role is not None:
            role.cancel()
        if election is not None:  # resign: another replica leads at once instead of after the etcd lease's ttl
            await election.stop()

    await svc.wait_for_termination(grace=5.0, drain=on_stop)  # the revocation streams get the grace
    sweeper.cancel()
    if role is not None:
        role.cancel()


async def replica_life(args, svc: Service, election: Election, servicer: BrokerServicer,
                       collector: LeadershipCollector, new_table, first) -> None:
    """Term after term: follow, take over (the cluster's epoch), lead, and once the term is over answer nothing
    more from its table: a fresh one, with a fresh authority, waits for the next term this replica wins."""
    table, authority, free_set = first
    while True:
        async def take_over(term: int, table=table) -> None:
            table.take_identity(await shared_epoch(election, args.cluster), term)

        async def on_lead(term: int, table=table, free_set=free_set) -> None:
            log.warning("broker leads term %d (epoch %#x); answering", term, table.epoch)
            await svc.set_health(True)
            cleanups.append(asyncio.create_task(forget_orphans(free_set, table)))

        async def forget_orphans(free_set: DurableFreeSet, table) -> None:
            # past the fence no decode hands an earlier term's pool over: it has registered anew or stopped
            await asyncio.sleep(args.reader_ttl + args.max_ttl + args.lock_delay)
            try:
                await free_set.forget_orphans(table.pool_ids)
            except (NotLeaderError, *RETRYABLE) as e:
                log.warning("deleting the durable free sets of pools no decode handed over failed: %r", e)

        async def on_lapse(answering: bool) -> None:
            log.warning("broker: authority %s", "resumed: answering again" if answering else
                        "lapsed (no etcd renewal within the bound): answering nothing until it resumes")
            await svc.set_health(answering)

        async def on_term_over(why: str) -> None:
            log.error("broker: %s; answering nothing from its table any more; following with a fresh one", why)
            await svc.set_health(False)

        cleanups: list[asyncio.Task] = []
        try:
            await lead_one_term(authority, take_over, on_lead, on_lapse, on_term_over)
        finally:
            for task in cleanups:
                task.cancel()
        table = new_table()
        authority, free_set = ElectedAuthority(election), DurableFreeSet(election, args.cluster, table)
        collector.authority = authority
        servicer.reset(table, authority, free_set)


def main(args) -> None:
    setup_logging()
    asyncio.run(serve(args))
