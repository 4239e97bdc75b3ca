"""The prefix cache scope of a request (issue 20): decode and prefill reuse a cached KV page only within one scope,
so the gateway alone decides who may share. `--prefix-cache on` (the default): scope_key(tenant, cache_salt,
--prefix-cache-scope); the tenant is the caller's API key's (keys.py), '' when the gateway has no keys. `off`: no
scope, and the Run and Prefill requests are the ones sent before prefix reuse existed."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..common.errors import invalid
from ..common.metrics import ADMISSION_REJECTIONS
from ..common.prefix import MAX_CACHE_SALT, SCOPES, scope_key

MODES = ("on", "off")


@dataclass(frozen=True, slots=True)
class Scoping:
    enabled: bool = True
    scope: str = "tenant"

    def __post_init__(self):
        if self.scope not in SCOPES:
            raise ValueError(f"prefix cache scope {self.scope!r} is not one of {SCOPES}")

    def scope_of(self, tenant: str, cache_salt: str) -> bytes:
        """The request's 16-byte scope, or b'' when the cache is off. cache_salt is checked either way: a client
        is told about a bad field whatever the operator's setting."""
        check_cache_salt(cache_salt)
        if not self.enabled:
            return b""
        return scope_key(tenant, cache_salt, self.scope)


def check_cache_salt(cache_salt: str) -> None:
    n = len(cache_salt.encode())
    if n > MAX_CACHE_SALT:
        ADMISSION_REJECTIONS.labels("BAD_CACHE_SALT").inc()
        raise invalid("BAD_CACHE_SALT", f"cache_salt is {n} bytes; at most {MAX_CACHE_SALT}")


def add_prefix_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix-cache", choices=MODES, default="on",
                   help="reuse the KV pages of a prompt prefix that decode or prefill already holds, within the "
                        "request's scope; off: every prompt is computed and transferred in full")
    p.add_argument("--prefix-cache-scope", choices=SCOPES, default="tenant",
                   help="tenant: requests share cached pages only within their API key's tenant and cache_salt; "
                        "global: across tenants too (cache_salt still separates): a choice for an operator whose "
                        "tenants trust each other, since a shared prefix shows in the time to first token")
    p.add_argument("--prefix-route-max-load-gap", type=int, default=4, metavar="N",
                   help="a request goes to the backend that most likely holds its prefix unless that one's queue "
                        "(requests waiting or running, as GetInfo reports plus what the gateway sent since) is "
                        "more than N deeper than the least loaded one's, or it lacks the free pages another has")
    p.add_argument("--prefix-route-entries", type=int, default=1 << 16, metavar="N",
                   help="prefixes the gateway remembers per role (least recently used forgotten first)")


def scoping_from_args(args) -> Scoping:
    if args.prefix_route_max_load_gap < 0:
        raise SystemExit(f"gateway: --prefix-route-max-load-gap must be >= 0, got {args.prefix_route_max_load_gap}")
    if args.prefix_route_entries < 1:
        raise SystemExit(f"gateway: --prefix-route-entries must be >= 1, got {args.prefix_route_entries}")
    return Scoping(args.prefix_cache == "on", args.prefix_cache_scope)
