"""`pdserve prefill`: one prefill instance."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

# Read by OpenMP (torch's threads) once, when torch loads, so set before anything here imports it. Prefill's torch
# threads share cores with decode, at a lower priority: one that waits at a barrier for a sibling that decode has
# preempted must sleep, not spin (spinning, 2 threads took 3.4x the CPU of 1 for a 1,024-token forward on 2 busy
# cores; asleep, 1.1x). A bounded spin (GOMP_SPINCOUNT=10000) made a 128-token forward 8-9 ms against 14 on an
# idle machine, but in the stack on busy cores its passes measured no faster, and slower with 16 streams decoding.
# An operator's own setting stands.
_OMP_ENV_BEFORE_TORCH = "torch" not in sys.modules
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from ..common import config  # noqa: E402
from ..common.capacity import check_pool_capacity
from ..common.cli_args import add_engine_args, load_runner
from ..common.hub import model_path
from ..common.metrics import init_metrics, track_load
from ..common.proto import prefill_pb2, prefill_pb2_grpc
from ..common.server import GRPC_OPTIONS, Service, setup_logging
from ..common.broker_client import broker_stub
from ..common.tls import own_identity, tls_from_args
from ..common.unsafe import check_unsafe
from ..check import prefill_plan, read_model_config
from ..engine.grammar import Grammars
from ..kvtransfer.engine import DEFAULT_MAX_WRITE_BYTES, MOONCAKE_MIN_TIMEOUT_S, TransferEngine, timeout_error
from .drain import drain
from .servicer import PrefillServicer
from .worker import PrefillWorker
from .writelease import TimingBoundError, WriteLeases

log = logging.getLogger(__name__)


def _at_least_one(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return int(text)


def _mooncake_timeout(text: str) -> int:
    """Whole seconds >= 5, checked with the other flags: the timing bound is checked before the engine starts."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be whole seconds, got {text!r}") from None
    if (err := timeout_error(value)) is not None:
        raise argparse.ArgumentTypeError(err)
    return int(value)


def _at_least_zero(text: str) -> int:
    if int(text) < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return int(text)


def _nice(text: str) -> int:
    if not 0 <= int(text) <= 19:
        raise argparse.ArgumentTypeError(f"must be 0-19 (added to the process's nice value), got {text}")
    return int(text)


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p, "prefill", config.PREFILL_PORT, config.DEFAULT_PREFILL_POOL_TOKENS)
    p.add_argument("--compute-nice", type=_nice, default=10,
                   help="how much lower than the rest of prefill (its event loop, RPCs and Mooncake's threads) the "
                        "threads that compute run (the forward pass, checksums, writes: asyncio's worker threads and "
                        "the torch threads they start), as a nice increment: prefill takes every core (--threads "
                        "defaults to all of them here) and a decode on the same cores still gets them first "
                        "(nice 10: about a tenth of a core's time against a busy nice-0 thread). 0: the same "
                        "priority as decode")
    p.add_argument("--writer-ttl", type=float, default=5.0, help="liveness lease of one write, seconds")
    p.add_argument("--transfer-timeout", type=float, default=30.0,
                   help="bound on one request's KV transfer as the caller sees it; a write still running then is "
                        "acknowledged (as failed) once its transport call returns")
    p.add_argument("--mooncake-timeout", type=_mooncake_timeout, default=MOONCAKE_MIN_TIMEOUT_S,
                   help="Mooncake's own transfer timeout (MC_TRANSFER_TIMEOUT), whole seconds >= 5; set explicitly")
    p.add_argument("--drain-timeout", type=float, default=10.0,
                   help="on SIGTERM, seconds in-flight Prefill calls get to finish; past it they fail UNAVAILABLE "
                        "(DRAINING) and the gateway retries them on another prefill before the first token")
    p.add_argument("--prefill-max-batch-tokens", type=_at_least_one, default=2048,
                   help="tokens in one forward pass: prompts are packed up to it and a longer prompt runs in chunks")
    p.add_argument("--prefill-queue-limit", type=_at_least_one, default=256,
                   help="prompts waiting for or in a forward pass; one more is refused with RESOURCE_EXHAUSTED "
                        "(PREFILL_QUEUE_FULL)")
    p.add_argument("--landing-slack", type=float, default=1.0,
                   help="seconds a task still in flight when its batch call returns may take to land; with Mooncake's "
                        "timeout + 1 ns/byte of the largest batch call it bounds how long after it was posted a write "
                        "can land, which must not exceed the broker's --lock-delay (checked at start-up)")
    p.add_argument("--max-write-bytes", type=_at_least_one, default=DEFAULT_MAX_WRITE_BYTES,
                   help="the write unit: no Mooncake batch call covers more bytes (a write is cut into calls at page "
                        "boundaries; one page must fit). The landing bound grows with it, not with the pool")
    p.add_argument("--prefix-cache", choices=("on", "off"), default="on",
                   help="keep the KV of prompt pages this prefill computed (per prefix scope, checksummed) and skip "
                        "the forward pass over a cached prefix; off: every prompt is computed whole (chain keys are "
                        "still written into the tags of requests that carry a prefix scope)")
    p.add_argument("--prefix-cache-pages", type=_at_least_zero, default=None,
                   help="at most this many pages of the prefill pool hold cached prefixes (default: any page no "
                        "prompt needs; cached pages are evicted least recently used whenever a prompt needs them)")


def compute_threads(nice: int, max_workers: int = 32, name: str = "prefill-compute") -> ThreadPoolExecutor:
    """asyncio's worker threads for prefill: each one lowers its own priority by `nice` as it starts (on Linux a nice
    value belongs to a thread, and a thread inherits its creator's, so the torch (OpenMP) threads a forward pass
    starts run at it too). More workers than asyncio's default (cores + 4): a write now waits asleep for Mooncake,
    and 16 of them must not keep the next forward pass out of the pool. The forward passes get a pool of one thread
    of their own (the batcher's executor): OpenMP keeps a team of torch threads per thread that runs a parallel op, so
    passes that hop between these workers leave a team on each (prefill held 47-50 threads after a short load, 34-38
    with one forward thread)."""
    def lower() -> None:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))

    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name,
                              initializer=lower if nice else None)


async def serve(args) -> None:
    check_unsafe("prefill", args)  # before the model loads: a refusal is immediate
    from ..engine.runner import available_cpus
    if not _OMP_ENV_BEFORE_TORCH:
        log.warning("torch was loaded before prefill set OMP_WAIT_POLICY=%s: its threads may spin while they wait",
                    os.environ["OMP_WAIT_POLICY"])
    # prefill computes on every core it may use, below decode's priority (--compute-nice); decode keeps its half
    args.threads = args.threads or available_cpus()
    asyncio.get_running_loop().set_default_executor(compute_threads(args.compute_nice))
    tls = tls_from_args(args, "prefill", "prefill")
    # listening before the model loads: probes see NOT_SERVING (alive, not ready) during a long load
    svc = Service("prefill", [prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name],
                  args.host, args.port, args.metrics_port, tls=tls, metrics_host=args.metrics_host)
    holder = svc.hold(prefill_pb2_grpc.add_PrefillServicer_to_server,
                      prefill_pb2.DESCRIPTOR.services_by_name["Prefill"])
    await svc.start()
    servicer = await svc.starting(_start(args, tls))
    holder.servicer = servicer
    track_load("prefill", servicer.load)
    await svc.set_serving()
    await svc.wait_for_termination(drain=lambda: drain(servicer, args.drain_timeout), drain_timeout=args.drain_timeout)


async def _start(args, tls) -> PrefillServicer:
    """Refuses what config.json alone shows to be wrong before anything is allocated (the checks `pdserve check`
    prints), loads the model (in a thread: the server answers health meanwhile), checks the timing bound with the
    broker, then starts the transfer engine: a refused start opens no transfer port."""
    cfg = await asyncio.to_thread(read_model_config, args.model)
    plan = prefill_plan(args, cfg)
    if plan.refusals:
        raise SystemExit(plan.refusals[0])
    runner = await load_runner(args, "prefill")
    num_pages = runner.pool.num_pages
    context_length = args.context_length or runner.config.max_position_embeddings
    log.info("%s", runner.describe(context_length))
    pool_name = f"prefill-{args.port}"
    init_metrics("prefill", [pool_name])
    max_prompt = check_pool_capacity("prefill", pool_name, num_pages * args.page_size, context_length,
                                     args.allow_pool_smaller_than_context)
    log.info("prefill pool: %s", "; ".join(f"{k} {v}" for k, v in plan.facts))
    broker = broker_stub(args.broker, tls, GRPC_OPTIONS)
    # the broker lets a prefill name only writer ids under its own identity
    writer_prefix = f"{own_identity(tls, 'prefill')}/{os.getpid()}-{secrets.token_hex(4)}"
    # the largest batch call is one write unit, whatever the pool's size (worker.py cuts every write into them)
    max_landing, terms = plan.max_landing_s, plan.landing_terms
    leases = WriteLeases(broker, writer_prefix, max_landing, writer_ttl_s=args.writer_ttl, landing_terms=terms)
    while True:  # SERVING only once the broker's lock_delay covers the longest from a post to its landing
        try:
            lock_delay = await leases.check_bounds()
            break
        except TimingBoundError as e:
            raise SystemExit(f"prefill: refusing to start: {e}") from None
        except Exception as e:  # noqa: BLE001
            log.warning("asking broker %s for its lock_delay failed (%s); retrying", args.broker, e)
            await asyncio.sleep(0.5)
    log.info("timing bound holds: a posted write lands within %.3fs after it was posted (%s) <= broker lock_delay "
             "%.3fs", max_landing, terms, lock_delay)
    transfer = TransferEngine(args.host, args.protocol, timeout_s=args.mooncake_timeout, port=args.transfer_port,
                              max_write_bytes=args.max_write_bytes)
    worker = PrefillWorker(runner, transfer, checksums=not args.no_transfer_checksum,
                           max_write_bytes=args.max_write_bytes, prefix_cache=args.prefix_cache == "on",
                           prefix_cache_pages=args.prefix_cache_pages)
    log.info("prefix cache: %s", "off" if not worker.cache.enabled else
             f"on, at most {args.prefix_cache_pages} pages" if args.prefix_cache_pages is not None else
             "on, up to the pool's unused pages")
    servicer = PrefillServicer(worker, leases, context_length, max_prompt,
                               os.path.basename(os.path.normpath(args.model)), transfer_timeout_s=args.transfer_timeout,
                               max_batch_tokens=args.prefill_max_batch_tokens, queue_limit=args.prefill_queue_limit,
                               grammars=Grammars.for_model(model_path(args.model), runner.config))
    servicer.batcher.executor = compute_threads(args.compute_nice, max_workers=1, name="prefill-forward")
    return servicer


def main(args) -> None:
    setup_logging()
    asyncio.run(serve(args))
