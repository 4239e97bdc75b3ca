"""`pdserve decode`: one decode instance; registers its pool with the broker before serving."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets

from ..common import config
from ..common.capacity import check_pool_capacity
from ..common.cli_args import add_engine_args, load_runner
from ..common.hub import model_path
from ..common.metrics import init_metrics, track_load
from ..common.proto import decode_pb2, decode_pb2_grpc
from ..common.server import GRPC_OPTIONS, Service, setup_logging
from ..common.broker_client import broker_stub
from ..common.tls import own_identity, tls_from_args
from ..common.unsafe import check_unsafe
from ..engine.grammar import Grammars
from ..kvtransfer.engine import TransferEngine
from .drain import drain
from .servicer import DecodeServicer

log = logging.getLogger(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p, "decode", config.DECODE_PORT, config.DEFAULT_DECODE_POOL_TOKENS)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--allocation-timeout", type=float, default=120.0,
                   help="seconds an allocation waits for its Decode call (prefill failed, gateway gone) before "
                        "release, plus --allocation-timeout-per-token per prompt token")
    p.add_argument("--allocation-timeout-per-token", type=float, default=0.005,
                   help="seconds the allocation timeout grows per prompt token (a long prompt's prefill takes longer)")
    p.add_argument("--allocation-queue-limit", type=int, default=256,
                   help="requests that may wait for KV pages while the pool is full; more get RESOURCE_EXHAUSTED")
    p.add_argument("--allocation-queue-timeout", type=float, default=30.0,
                   help="seconds a request waits for KV pages before RESOURCE_EXHAUSTED (QUEUE_TIMEOUT)")
    p.add_argument("--checksum-sweep-pages", type=int, default=8,
                   help="N: prompt pages of the running batch whose CRC-32C is re-checked before every E-th step "
                        "(--checksum-sweep-every), in rotation: every prompt page at least once every E * ceil(P / N) "
                        "steps, P the batch's prompt pages; 0 turns it off")
    p.add_argument("--checksum-sweep-every", type=int, default=8,
                   help="the sweep runs before every E-th step: its cost, mostly fixed per call, divided by E")
    p.add_argument("--max-blind", type=float, default=1.0,
                   help="seconds decode keeps stepping without a message (revocation or heartbeat) from the broker's "
                        "revocation stream; then running requests fail UNAVAILABLE. Must be <= lock_delay / 2")
    p.add_argument("--rpc-timeout", type=float, default=10.0,
                   help="timeout of decode's broker RPCs; keep <= the broker's --reconcile-grace")
    p.add_argument("--drain-timeout", type=float, default=25.0,
                   help="on SIGTERM, seconds running streams (and granted allocations) get to finish; then streams "
                        "are handed back (UNAVAILABLE DRAINED with the tokens streamed: the gateway continues them on "
                        "another decode), allocations end UNAVAILABLE DRAINING, and their leases are released. Keep "
                        "under the pod's terminationGracePeriodSeconds")
    p.add_argument("--headroom-pages", type=int, default=config.DEFAULT_HEADROOM_PAGES,
                   help="pages on demand: pages a request is leased beyond its prompt before its first token, and "
                        "kept ahead of it while it generates (the rest is leased as it goes, in batched Extend calls)")
    p.add_argument("--growth-pages", type=int, default=8,
                   help="pages one growth asks for per sequence (or an eighth of what it holds, whichever is more)")
    p.add_argument("--preempt-after", type=float, default=0.5,
                   help="seconds a running request may lack a page for its next step (the pool dry) before the "
                        "youngest running request is preempted (PREEMPTED; the gateway resubmits it)")
    p.add_argument("--prefix-cache", choices=("on", "off"), default="on",
                   help="decode-side prefix reuse: share checked cached pages of a request's prefix scope and publish "
                        "its full prompt pages (off: neither; the chain words prefill writes are still checked)")
    p.add_argument("--canary", action="store_true",
                   help="tests: fill released pages with a marker and refuse a verified page that carries it")


async def serve(args) -> None:
    check_unsafe("decode", args)  # before the model loads: a refusal is immediate
    tls = tls_from_args(args, "decode", "decode")
    if args.headroom_pages < 1 or args.growth_pages < 1 or args.preempt_after < 0:
        raise SystemExit(f"--headroom-pages and --growth-pages must be >= 1 and --preempt-after >= 0, got "
                         f"{args.headroom_pages}, {args.growth_pages} and {args.preempt_after}")
    if args.checksum_sweep_pages < 0 or args.checksum_sweep_every < 1:
        raise SystemExit(f"--checksum-sweep-pages must be >= 0 and --checksum-sweep-every >= 1, got "
                         f"{args.checksum_sweep_pages} and {args.checksum_sweep_every}")
    # listening before the model loads: probes see NOT_SERVING (alive, not ready) during a long load
    svc = Service("decode", [decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name],
                  args.host, args.port, args.metrics_port, tls=tls, metrics_host=args.metrics_host)
    holder = svc.hold(decode_pb2_grpc.add_DecodeServicer_to_server, decode_pb2.DESCRIPTOR.services_by_name["Decode"])
    await svc.start()
    servicer = await svc.starting(_start(args, tls))
    holder.servicer = servicer
    track_load("decode", servicer.load)
    link = servicer.link
    tasks = [asyncio.create_task(servicer.scheduler.run()), asyncio.create_task(link.expire_allocations()),
             asyncio.create_task(link.watch_epoch()), asyncio.create_task(link.watch_revocations())]
    await svc.starting(link.watching.wait())  # a request must never run before decode can hear its revocation
    await svc.set_serving()
    # the loops keep running while draining: streams still step, leases are still renewed and released
    await svc.wait_for_termination(drain=lambda: drain(servicer, args.drain_timeout), drain_timeout=args.drain_timeout)
    for t in tasks:
        t.cancel()


async def _start(args, tls) -> DecodeServicer:
    """Loads the model (in a thread: the server answers health meanwhile) and registers the pool."""
    runner = await load_runner(args, "decode")
    num_pages = runner.pool.num_pages
    if args.checksum_sweep_pages == 0 or args.no_transfer_checksum:
        log.warning("checksum sweep OFF (%s): a late write of page data alone into a running request's prompt "
                    "page will not be detected", "--checksum-sweep-pages 0" if args.checksum_sweep_pages == 0
                    else "--no-transfer-checksum leaves no verified checksum to compare with")
    context_length = args.context_length or runner.config.max_position_embeddings
    log.info("%s", runner.describe(context_length))
    # unique per incarnation: a restarted decode never inherits leases of its predecessor; under its own
    # identity, because the broker lets a decode name only pools that start with it
    pool_id = f"{own_identity(tls, 'decode')}/{args.host}-{args.port}-{os.getpid()}-{secrets.token_hex(4)}"
    init_metrics("decode", [pool_id])
    check_pool_capacity("decode", pool_id, num_pages * args.page_size, context_length,
                        args.allow_pool_smaller_than_context)
    transfer = TransferEngine(args.host, args.protocol, port=args.transfer_port)
    transfer.register(runner.pool.data_ptr, runner.pool.data_nbytes)
    transfer.register(runner.pool.tag_ptr, runner.pool.tag_nbytes)
    servicer = DecodeServicer(runner, broker_stub(args.broker, tls, GRPC_OPTIONS), pool_id, transfer.session,
                              context_length, os.path.basename(os.path.normpath(args.model)), args.max_batch,
                              check_checksums=not args.no_transfer_checksum, canary=args.canary,
                              allocation_timeout_s=args.allocation_timeout, rpc_timeout_s=args.rpc_timeout,
                              max_blind_s=args.max_blind, sweep_pages=args.checksum_sweep_pages,
                              sweep_every=args.checksum_sweep_every, queue_limit=args.allocation_queue_limit,
                              queue_timeout_s=args.allocation_queue_timeout, headroom_pages=args.headroom_pages,
                              growth_pages=args.growth_pages, preempt_after_s=args.preempt_after,
                              allocation_timeout_per_token_s=args.allocation_timeout_per_token,
                              prefix_cache=args.prefix_cache == "on",
                              grammars=Grammars.for_model(model_path(args.model), runner.config))
    servicer.transfer = transfer  # held for the process's life: the engine unregisters the pool when collected
    while True:  # SERVING only once the pool is allocated, registered and checked
        try:
            epoch = await servicer.link.register()
            break
        except Exception as e:
            log.warning("registering pool %s with broker %s failed (%s); retrying", pool_id, args.broker, e)
            await asyncio.sleep(0.5)
    if servicer.link.bound_error:
        raise SystemExit(f"decode refuses to start: {servicer.link.bound_error}")
    log.info("pool %s registered: %d pages of %d tokens, epoch %#x", pool_id, num_pages, args.page_size, epoch)
    return servicer


def main(args) -> None:
    setup_logging()
    asyncio.run(serve(args))
