"""Command-line flags shared by every service, and those shared by the two engine services (prefill and decode)."""
from __future__ import annotations

import argparse

from . import config
from .tls import add_tls_args
from .unsafe import add_unsafe_args


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
    p.add_argument("--model", default=config.DEFAULT_MODEL)
    p.add_argument("--context-length", type=int, default=0, help="default: the model's max_position_embeddings")
    p.add_argument("--page-size", type=int, default=config.DEFAULT_PAGE_SIZE)
    p.add_argument("--pool-tokens", type=int, default=pool_tokens)
    p.add_argument("--allow-pool-smaller-than-context", action="store_true",
                   help="serve with admission capped at the pool (the shortfall is exported for an alert)")
    p.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"])
    p.add_argument("--transfer-port", type=_transfer_port, default=0,
                   help="Mooncake listens on this port and the next (its handshake RPC and its tcp data port, in "
                        "either order), e.g. for a NetworkPolicy; 0: two random ports in 15000-17000")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for the model (default: half the cores, prefill and decode share a host)")
    p.add_argument("--switch-interval-ms", type=float, default=0.5,
                   help="Python's GIL switch interval: how long the model thread may wait for the event loop to "
                        "let go (Python's default 5 ms cost 15-20%% of decode throughput at 16 streams)")
    p.add_argument("--no-transfer-checksum", action="store_true",
                   help="UNSAFE, needs --allow-unsafe no-transfer-checksum: skip the CRC-32C of transferred pages (tags "
                        "are still checked, the bytes are not); prefill and decode must agree")
    p.add_argument("--kv-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add_tls_args(p)
