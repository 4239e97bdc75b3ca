"""Who can reach the gateway's public APIs without a key. Without API keys every caller is the one tenant ''
(keys.py), so every caller shares one prefix-cache scope: the time to first token tells anyone who can reach the
port whether someone else sent a given system prompt and first turn, besides letting them generate at all. On
loopback that is the local user's own stack (`pdserve up`, `make run`); beyond it, the gateway refuses to start
without keys unless the operator says `--allow-unauthenticated` (an authenticating proxy in front, a closed lab
network). The public gRPC and HTTP APIs share `--host`; the metrics port binds its own `--metrics-host` and serves
no model, so it is not judged here."""
from __future__ import annotations

import argparse
import ipaddress
import logging

from .keys import ApiKeys

log = logging.getLogger(__name__)

FLAG = "--allow-unauthenticated"


def add_exposure_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(FLAG, action="store_true",
                   help="start with no API key although --host is not a loopback address (every caller who reaches "
                        "the gRPC or HTTP port may generate, and all share one prefix-cache scope); without it such "
                        "a gateway refuses to start. For a gateway behind a proxy that authenticates callers itself")


def is_loopback(host: str) -> bool:
    """Only what cannot be reached from another machine: 127.0.0.0/8, ::1 and the name localhost. Any other name is
    not resolved (what it resolves to can change after start-up) and counts as reachable, as does '' (every
    interface)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, port: int, http_port: int, keys: ApiKeys | None, allowed: bool) -> None:
    """Raises SystemExit (one line) for a keyless gateway beyond loopback unless allowed; logs the allowed one once."""
    if keys is not None or is_loopback(host):
        if allowed:
            log.warning("gateway: %s given but %s: nothing to allow", FLAG,
                        "API keys are required" if keys is not None else f"--host {host} is loopback")
        return
    at = f"[{host}]" if ":" in host and not host.startswith("[") else host  # an IPv6 address, as in a URL
    ports = f"gRPC API on {at}:{port}" + (f" and HTTP API on {at}:{http_port}" if http_port >= 0 else "")
    risk = (f"the public {ports} would take every caller with no API key: anyone who reaches them can generate, and "
            "every caller shares one prefix-cache scope, so the time to first token shows whether someone else sent "
            "a prompt")
    if not allowed:
        raise SystemExit(f"gateway: refusing to start: {risk}. Give --api-keys-file (or --api-key / PDSERVE_API_KEY), "
                         f"bind --host 127.0.0.1, or pass {FLAG} to run open anyway")
    log.warning("gateway: UNAUTHENTICATED (%s): %s", FLAG, risk)
