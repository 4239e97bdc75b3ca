"""Command-line flags shared by every service, and those shared by the two engine services (prefill and decode)."""
from __future__ import annotations

import argparse
import logging
import re

from . import config
from .tls import add_tls_args
from .unsafe import add_unsafe_args

log = logging.getLogger(__name__)
DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float16"]
DEVICE = re.compile(r"cpu|cuda(:\d+)?")
MODEL_HELP = ("a checkpoint directory, or a Hugging Face id (ORG/NAME) already in the local hub cache ($HF_HUB_CACHE, "
              "else $HF_HOME/hub, else ~/.cache/huggingface/hub): nothing is downloaded")


def add_service_args(p: argparse.ArgumentParser) -> None:
    """Flags every service takes."""
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the Prometheus /metrics port binds (Kubernetes deployments pass 0.0.0.0 so the "
                        "pod can be scraped)")
    add_unsafe_args(p)


def _transfer_port(text: str) -> int:
    """Checked when the flags are read: a port Mooncake would ignore is refused before the model loads."""
    from ..kvtransfer.engine import transfer_ports
    port = int(text)
    if port:
        try:
            transfer_ports(port)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return port


def add_engine_args(p: argparse.ArgumentParser, service: str, port: int, pool_tokens: int) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--metrics-port", type=int, default=config.METRICS_PORTS[service])
    add_service_args(p)
    p.add_argument("--broker", default=f"127.0.0.1:{config.BROKER_PORT}")
    p.add_argument("--model", default=config.DEFAULT_MODEL, help=MODEL_HELP)
    p.add_argument("--context-length", type=int, default=0, help="default: the model's max_position_embeddings")
    p.add_argument("--page-size", type=int, default=config.DEFAULT_PAGE_SIZE)
    size = p.add_mutually_exclusive_group()  # one of them decides the pool; --pool-tokens when none is given
    size.add_argument("--pool-tokens", type=int, default=pool_tokens, help="KV pool size in tokens (what decides "
                      "unless --kv-cache-memory or --gpu-memory-utilization is given)")
    size.add_argument("--kv-cache-memory", type=_bytes, default=0, metavar="BYTES",
                      help="KV pool size as memory, e.g. 4GiB, 512MiB, 2GB: as many whole pages as fit (the page "
                           "data; the tags beside it take 32 bytes a page on the host)")
    size.add_argument("--gpu-memory-utilization", type=_fraction, default=0.0, metavar="F",
                      help="CUDA only: the KV pool takes this fraction (0 < F <= 1) of the device memory left once the "
                           "weights are loaded; refused on CPU")
    p.add_argument("--allow-pool-smaller-than-context", action="store_true",
                   help="serve with admission capped at the pool (the shortfall is exported for an alert)")
    p.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"])
    p.add_argument("--transfer-port", type=_transfer_port, default=0,
                   help="Mooncake listens on this port and the next (its handshake RPC and its tcp data port, in "
                        "either order), e.g. for a NetworkPolicy; 0: two random ports in 15000-17000")
    p.add_argument("--device", type=device_arg, default=None,
                   help="cpu, cuda or cuda:N, the device this instance runs on (default: cuda when present, else cpu)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for the model (default: decode half the cores; prefill all of them, below "
                        "decode's priority: --compute-nice)")
    p.add_argument("--switch-interval-ms", type=float, default=0.5,
                   help="Python's GIL switch interval: how long the model thread may wait for the event loop to "
                        "let go (Python's default 5 ms cost 15-20%% of decode throughput at 16 streams)")
    p.add_argument("--no-transfer-checksum", action="store_true",
                   help="UNSAFE, needs --allow-unsafe no-transfer-checksum: skip the CRC-32C of transferred pages (tags "
                        "are still checked, the bytes are not); prefill and decode must agree")
    add_dtype_args(p)
    add_tls_args(p)


def add_dtype_args(p: argparse.ArgumentParser) -> None:
    """The weights' and the KV pool's dtypes: the engine services', and `up`'s and `check`'s for them."""
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="dtype of the weights; auto: the checkpoint's (config.json torch_dtype, else the "
                        "tensors' own)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-dtype", default="auto", choices=DTYPE_CHOICES,
                    help="dtype of the KV pool; auto: the weights' dtype")
    kv.add_argument("--kv-dtype", dest="kv_dtype_alias", default=None, choices=DTYPE_CHOICES[1:],
                    help="DEPRECATED alias of --kv-cache-dtype: sets the KV pool's dtype only (it once set the "
                         "weights' too; use --dtype for those)")


def device_arg(text: str) -> str:
    if not DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    return text


def check_device(service: str, device: str | None) -> None:
    """A CUDA device this host does not have ends the start with one line, before the model loads (torch would
    fail later, deep in the loader)."""
    if device is None or device == "cpu":
        return
    import os

    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise SystemExit(f"{service}: --device {device}: torch {torch.__version__} sees {count} CUDA device(s) here"
                         f"{f' (cuda:0..cuda:{count - 1})' if count else ''}"
                         f"{'' if visible is None else f', CUDA_VISIBLE_DEVICES={visible!r}'}")


def _bytes(text: str) -> int:
    from ..engine.sizing import parse_bytes
    try:
        value = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be > 0 bytes, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {value}")
    return value


def engine_dtypes(args) -> tuple[str, str]:
    """(weights, KV pool) as requested, 'auto' resolved by the runner; the deprecated alias warns, once, here."""
    kv = args.kv_cache_dtype
    if args.kv_dtype_alias is not None:
        log.warning("--kv-dtype is deprecated: it is --kv-cache-dtype %s and sets only the KV pool's dtype; the "
                    "weights follow --dtype (%s)", args.kv_dtype_alias, args.dtype)
        kv = args.kv_dtype_alias
    return args.dtype, kv


async def load_runner(args, service: str):
    """The model and its KV pool as the engine flags ask (threads, dtypes, pool size), loaded in a thread so the
    server answers health meanwhile; a pool size that cannot be served ends the start with one line."""
    import asyncio

    from ..engine.heap import keep_freed_memory
    from ..engine.runner import ModelRunner, set_threads
    from ..engine.sizing import PoolSizeError
    from .hub import model_path
    check_device(service, args.device)
    path = model_path(args.model)  # a hub id not in the cache ends the start here, naming the folder looked in
    set_threads(args.threads, args.switch_interval_ms)
    log.info("%s", keep_freed_memory())
    dtype, kv_dtype = engine_dtypes(args)
    size = pool_size(args, service)
    try:
        return await asyncio.to_thread(ModelRunner, path, size, args.page_size, dtype, args.device, kv_dtype,
                                       service == "prefill")
    except PoolSizeError as e:
        raise SystemExit(f"{service}: refusing to start: {e}") from None


def pool_size(args, service: str = "engine"):
    """The PoolSize the flags ask for: a memory budget or a fraction when given, else --pool-tokens. A fraction
    off CUDA is refused here, with one line, before the model loads."""
    from ..engine.runner import pick_device
    from ..engine.sizing import PoolSize
    if args.gpu_memory_utilization:
        device = args.device or pick_device().type
        if not str(device).startswith("cuda"):
            raise SystemExit(f"{service}: --gpu-memory-utilization {args.gpu_memory_utilization} needs a CUDA "
                             f"device, this service runs on {device}: size the pool with --pool-tokens or "
                             "--kv-cache-memory")
        return PoolSize(gpu_memory_utilization=args.gpu_memory_utilization)
    if args.kv_cache_memory:
        return PoolSize(memory_bytes=args.kv_cache_memory)
    return PoolSize(tokens=args.pool_tokens)
