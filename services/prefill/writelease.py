"""Prefill's side of the lease protocol with the broker: liveness of each write, BeginWrite (which names the only
region the write may go to), EndWrite (the abort acknowledgement, always sent), and the timing bound."""
from __future__ import annotations

import asyncio
import logging
import math
import time

import grpc

from ..common.deadline import timeout_within
from ..common.errors import PdError
from ..common.faults import FAULTS
from ..common.metrics import GUARD_SECONDS, LEASE_VIOLATIONS, TRANSFER_FAILURES
from ..common.proto import broker_pb2
from ..common.wire import call

log = logging.getLogger(__name__)


class TimingBoundError(RuntimeError):
    """The broker would free a page before a write this prefill posted can have landed."""


class WriteLeases:
    def __init__(self, broker, writer_prefix: str, max_landing_s: float, rpc_timeout_s: float = 10.0,
                 writer_ttl_s: float = 5.0, liveness_margin_s: float = 1.0):
        if not 0 < liveness_margin_s < writer_ttl_s:
            raise ValueError(f"liveness margin {liveness_margin_s}s must be in (0, writer ttl {writer_ttl_s}s)")
        self.broker = broker
        self.writer_prefix = writer_prefix
        self.max_landing_s = max_landing_s
        # the start-up check and every BeginWrite use the same whole milliseconds, so a bound that passes the one
        # can never be refused by the other
        self.max_landing_ms = math.ceil(max_landing_s * 1000)
        self.rpc_timeout_s = rpc_timeout_s
        self.writer_ttl_s = writer_ttl_s
        self.liveness_margin_s = liveness_margin_s

    async def check_bounds(self) -> float:
        """At start-up: the broker must hold a page at least as long as a posted write can still land after its
        call returned (max_landing <= lock_delay); returns lock_delay. Raises TimingBoundError with the numbers."""
        resp = await call(self.broker.KeepAlive(broker_pb2.KeepAliveRequest(
            holder_id=f"{self.writer_prefix}/startup", ttl_ms=1000), timeout=self.rpc_timeout_s), "broker KeepAlive")
        lock_delay = resp.lock_delay_ms / 1000
        if self.max_landing_ms > resp.lock_delay_ms:
            raise TimingBoundError(
                f"a write this prefill posts may land up to {self.max_landing_s:.3f}s after its call returned "
                f"(Mooncake timeout + 1 ns/byte of the pool + slack), but the broker frees a page {lock_delay:.3f}s "
                f"after a failed write's ack or its writer's liveness expiry (lock_delay): raise the broker's "
                f"--lock-delay to at least {self.max_landing_s:.3f} or lower prefill's --mooncake-timeout")
        return lock_delay

    async def keep_alive(self, writer_id: str, epoch: int, deadline: float | None = None) -> float:
        """Renews this write's liveness lease; returns the monotonic time it now expires (sent time + ttl).
        Under a new broker epoch the write is dead: its pages are quarantined only for lock_delay there,
        so it must not post again (found by the formal model)."""
        sent = time.monotonic()
        resp = await call(self.broker.KeepAlive(broker_pb2.KeepAliveRequest(
            holder_id=writer_id, ttl_ms=int(self.writer_ttl_s * 1000)),
            timeout=timeout_within(deadline, self.rpc_timeout_s, "before the write's KeepAlive")), "broker KeepAlive")
        if resp.epoch != epoch:
            raise PdError(grpc.StatusCode.UNAVAILABLE, "BROKER_RESTARTED",
                          f"broker epoch is {resp.epoch:#x}, the write's leases are of {epoch:#x}")
        return sent + self.writer_ttl_s

    async def begin(self, pool_id: str, owner: bytes, epoch: int, leases_pb, writer_id: str,
                    deadline: float | None = None):
        """KeepAlive, then BeginWrite; returns [liveness expiry], the task that renews it from now on (a long
        forward pass must not let the write's liveness lease lapse) and the pool's registered region. Both calls
        end by the request's deadline (EndWrite, a give-back, never does)."""
        expires = [await self.keep_alive(writer_id, epoch, deadline)]
        try:
            with GUARD_SECONDS.labels("begin_write_rpc").time():
                resp = await call(self.broker.BeginWrite(broker_pb2.BeginWriteRequest(
                    pool_id=pool_id, owner=owner, epoch=epoch, leases=leases_pb, writer_id=writer_id,
                    max_landing_ms=self.max_landing_ms),
                    timeout=timeout_within(deadline, self.rpc_timeout_s, "before the broker's BeginWrite")),
                    "broker BeginWrite")
        except PdError as e:
            TRANSFER_FAILURES.labels("begin_write").inc()
            if e.reason in ("LEASE_NOT_CURRENT", "WRITER_ACTIVE", "LEASE_ALREADY_WRITTEN"):
                LEASE_VIOLATIONS.labels("prefill", e.reason).inc()
                raise PdError(grpc.StatusCode.DATA_LOSS, e.reason, e.message) from None
            if e.reason == "EPOCH_MISMATCH":
                raise PdError(grpc.StatusCode.UNAVAILABLE, e.reason, e.message) from None
            raise
        return expires, asyncio.create_task(self._renew(writer_id, epoch, expires)), resp.region

    async def _renew(self, writer_id: str, epoch: int, expires: list[float]) -> None:
        while True:
            await asyncio.sleep(self.writer_ttl_s / 3)
            try:
                expires[0] = await self.keep_alive(writer_id, epoch)
            except PdError as e:
                log.warning("KeepAlive of %s failed: %s", writer_id, e)
                if e.reason == "BROKER_RESTARTED":
                    expires[0] = 0.0  # check_alive now refuses every further post
                    return

    async def end(self, pool_id, owner, epoch, leases_pb, writer_id: str, ok: bool, nothing_posted: bool) -> None:
        if FAULTS.fire("prefill.lose_end_write") is not None:
            return
        req = broker_pb2.EndWriteRequest(pool_id=pool_id, owner=owner, epoch=epoch, leases=leases_pb,
                                         writer_id=writer_id, success=ok, nothing_posted=nothing_posted and not ok)
        for attempt in range(3):  # the acknowledgement matters: the pages stay quarantined without it
            try:
                with GUARD_SECONDS.labels("end_write_rpc").time():
                    await self.broker.EndWrite(req, timeout=self.rpc_timeout_s)
                return
            except grpc.RpcError as e:
                log.warning("EndWrite attempt %d for %s failed: %s", attempt + 1, owner.hex(), e)
                await asyncio.sleep(0.2 * (attempt + 1))
        TRANSFER_FAILURES.labels("end_write").inc()
