"""The gateway's live set of prefill and decode backends: dial, check, poll load, retire.

A new target is dialled and asked GetInfo; it takes work only once its model, vocabulary and page layout
agree with what the gateway serves (pinned by the first backend it admitted, since the tokenizer and every
admission limit follow from it). One that disagrees is refused loudly and never routed to. Every backend is
polled every --load-interval; its answer is its load and whether it drains. A target that leaves discovery
stops getting new work at once; its channel closes only after the requests it carries have ended (plus the
bound of their give-back calls), so a request's Decode still reaches the pod that answered its Allocate.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import grpc
from prometheus_client import Gauge

from ..common.proto import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from ..common.server import GRPC_OPTIONS
from ..common.tls import TlsConfig, secure_channel
from .affinity import PrefixMap
from .discovery import is_ip, split_host_port
from .router import DRAINING, PENDING, READY, REFUSED, RETIRING, STATES, UNREACHABLE, Backend, Router

log = logging.getLogger(__name__)

BACKENDS = Gauge("pdserve_gateway_backends", "Backends the gateway knows, by role and state", ["role", "state"])
STUBS = {"prefill": prefill_pb2_grpc.PrefillStub, "decode": decode_pb2_grpc.DecodeStub}
# the Service name our certificates carry (pki.py): what a pod dialled by its address must prove it is
SERVER_NAMES = {"prefill": "pdserve-prefill", "decode": "pdserve-decode"}
RELEASE_BOUND_S = 10.0  # the servicer's Release timeout: a give-back spawned as a request ends may still run


def init_backend_metrics() -> None:
    for role in STUBS:
        for s in STATES:
            BACKENDS.labels(role, s).set(0)


def engine_key(info) -> tuple:
    return (info.model, info.vocab_size, info.page_size, info.layout.SerializeToString())


class Backends:
    def __init__(self, tls: TlsConfig | None, load_interval_s: float = 0.5,
                 on_change: Callable[[], None] = lambda: None, max_load_gap: int = 4,
                 prefix_entries: int = 1 << 16):
        self.tls = tls
        self.load_interval_s = load_interval_s
        self.on_change = on_change
        self.routers = {role: Router(role, prefixes=PrefixMap(prefix_entries), max_load_gap=max_load_gap)
                        for role in STUBS}
        self.key: tuple | None = None  # model/vocab/page layout of the first admitted backend
        self._tasks: dict[Backend, asyncio.Task] = {}
        init_backend_metrics()

    def update(self, role: str, targets: set[str], discovered: set[str] = frozenset()) -> None:
        """Discovery's answer for one role: dial what is new, retire what is gone."""
        router = self.routers[role]
        live = {b.target: b for b in router.all if b.state != RETIRING}
        for target in sorted(targets - live.keys()):
            host = split_host_port(target)[0]
            name = SERVER_NAMES[role] if target in discovered and is_ip(host) else None
            channel = secure_channel(target, self.tls, GRPC_OPTIONS, server_name=name)
            b = Backend(target, STUBS[role](channel), state=PENDING, channel=channel)
            router.all.append(b)
            self._tasks[b] = asyncio.get_running_loop().create_task(self._poll(role, b))
            log.info("%s %s: dialled%s; checking its GetInfo", role, target,
                     f" (certificate must name {name})" if name else "")
        for target in sorted(live.keys() - targets):
            b = live[target]
            log.info("%s %s: gone from discovery; no new work, %d requests in flight", role, target, b.in_flight)
            self._set(role, b, RETIRING)
            self._tasks.pop(b).cancel()
            asyncio.get_running_loop().create_task(self._retire(role, b))
        self._publish()

    def _set(self, role: str, b: Backend, state: str) -> None:
        if b.state == state:
            return
        old, b.state = b.state, state
        if state != REFUSED:  # a refusal is logged with its reason by _check
            level = logging.WARNING if state in (UNREACHABLE, DRAINING) else logging.INFO
            log.log(level, "%s %s: %s -> %s", role, b.target, old, state)
        self._publish()
        self.on_change()

    def _publish(self) -> None:
        for role, router in self.routers.items():
            for s in STATES:
                BACKENDS.labels(role, s).set(sum(b.state == s for b in router.all))

    def _check(self, role: str, b: Backend, info) -> bool:
        key = engine_key(info)
        if self.key is None:
            self.key = key
            log.info("gateway serves model %s (vocab %d, page %d) as its first backend %s %s reports",
                     info.model, info.vocab_size, info.page_size, role, b.target)
        if key == self.key:
            return True
        if b.state != REFUSED:
            log.error("%s %s REFUSED: it serves model %r vocab %d page %d layout %s; this gateway serves model %r "
                      "vocab %d page %d layout %s. It gets no work until it agrees.", role, b.target, info.model,
                      info.vocab_size, info.page_size, str(info.layout).replace("\n", " "), self.key[0],
                      self.key[1], self.key[2], str(common_pb2.KvLayout.FromString(self.key[3])).replace("\n", " "))
            self._set(role, b, REFUSED)
        return False

    async def _poll(self, role: str, b: Backend) -> None:
        timeout = max(1.0, 4 * self.load_interval_s)
        while True:
            sent = time.monotonic()
            try:
                info = await b.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=timeout)
            except grpc.RpcError as e:
                if b.state not in (PENDING, REFUSED):
                    log.warning("%s %s: GetInfo failed (%s: %s)", role, b.target, e.code().name, e.details())
                    self._set(role, b, UNREACHABLE)
            else:
                if self._check(role, b, info):
                    b.info = info
                    b.absorb(sent)
                    self._set(role, b, DRAINING if info.draining else READY)
            await asyncio.sleep(self.load_interval_s)

    async def _retire(self, role: str, b: Backend) -> None:
        while b.in_flight > 0:
            await asyncio.sleep(0.1)
        await asyncio.sleep(RELEASE_BOUND_S)
        self.routers[role].all.remove(b)
        self._publish()
        await b.channel.close()
        log.info("%s %s: retired, channel closed", role, b.target)

    def capacity_infos(self) -> dict[str, list]:
        """The engine facts admission is computed over: the backends that take work now."""
        return {role: [b.info for b in r.backends] for role, r in self.routers.items()}

    def is_usable(self) -> bool:
        return all(r.backends for r in self.routers.values())

    async def close(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        for r in self.routers.values():
            for b in r.all:
                await b.channel.close()
