"""The decode servicer's background loops: broker liveness and restarts (a new epoch), revocations, and
allocations whose Decode call never came. A mixin of DecodeServicer, whose state it reads and changes."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from ..common.errors import PdError
from ..common.metrics import TIMEOUTS
from ..common.proto import broker_pb2

log = logging.getLogger(__name__)


class BrokerWatch:
    async def watch_epoch(self, interval_s: float = 0.5, ttl_s: float = 5.0) -> None:
        """Keeps decode's liveness with the broker and notices a broker restart (a new epoch): in-flight
        requests fail UNAVAILABLE (retryable) and the pages they held return through quarantine."""
        while True:
            try:
                await asyncio.wait_for(self._epoch_changed.wait(), interval_s)
            except asyncio.TimeoutError:
                pass
            self._epoch_changed.clear()
            try:
                resp = await self.broker.KeepAlive(broker_pb2.KeepAliveRequest(
                    holder_id=self.pool_id, ttl_ms=int(ttl_s * 1000)), timeout=self.rpc_timeout_s)
            except grpc.RpcError as e:
                log.warning("broker unreachable (%s); running requests continue, new ones wait", e.code())
                continue
            if resp.epoch == self.epoch:
                continue
            # every page, not only those in use: one released just before the restart may still have an
            # old-epoch write in flight that no table remembers (found by the formal model)
            old, held = self.epoch, list(range(self.pool.num_pages))
            log.error("broker restarted (epoch %#x -> %#x): failing %d running requests, %d pages to quarantine",
                      old, resp.epoch, len(self.scheduler.running), len(held))
            self.scheduler.fail_all(PdError(grpc.StatusCode.UNAVAILABLE, "BROKER_RESTARTED",
                                            f"the broker restarted (epoch {old:#x} -> {resp.epoch:#x})"))
            try:
                await self.register(held)
            except PdError as e:
                log.error("re-registering pool %s failed: %s", self.pool_id, e)

    async def watch_revocations(self) -> None:
        """A revoked request stops before its next step."""
        while True:
            try:
                async for rev in self.broker.WatchRevocations(
                        broker_pb2.WatchRevocationsRequest(pool_id=self.pool_id)):
                    alloc = self.allocations.pop(rev.owner, None)
                    if alloc is not None:
                        log.warning("allocation %s revoked before its Decode: %s", rev.owner.hex(), rev.reason)
                    self.scheduler.revoke(rev.owner, PdError(grpc.StatusCode.DATA_LOSS, "REVOKED",
                                                             f"the broker revoked this request's leases: {rev.reason}"))
            except grpc.RpcError as e:
                log.warning("revocation stream ended (%s); resubscribing", e.code())
            await asyncio.sleep(0.5)

    async def expire_allocations(self, interval_s: float = 1.0) -> None:
        """Allocations whose Decode never came (prefill failed, gateway gone) end at their deadline."""
        while True:
            await asyncio.sleep(interval_s)
            now = time.monotonic()
            for owner, alloc in list(self.allocations.items()):
                if alloc.deadline < now:
                    self.allocations.pop(owner, None)
                    TIMEOUTS.labels("allocation").inc()
                    log.warning("allocation %s expired without a Decode call; releasing", owner.hex())
                    await asyncio.shield(self._release(owner, alloc.epoch, alloc.leases))
