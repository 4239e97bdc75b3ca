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
from ..common.metrics import GUARD_SECONDS, TRANSFER_FAILURES, count_violation
from ..common.proto import broker_pb2
from ..common.terms import Terms
from ..common.wire import call

log = logging.getLogger(__name__)


class TimingBoundError(RuntimeError):
    """The broker would free a page before a write this prefill posted can have landed."""


def landing_bound_error(max_landing_s: float, lock_delay_ms: int, terms: str) -> str | None:
    """The start-up refusal (without its "prefill: refusing to start: ") when L > lock_delay, else None; in the
    whole milliseconds every BeginWrite declares. `pdserve check` prints the same."""
    max_landing_ms = math.ceil(max_landing_s * 1000)
    if max_landing_ms <= lock_delay_ms:
        return None
    return (f"a write this prefill posts may land up to {max_landing_s:.3f}s after it was posted ({terms}), but "
            f"the broker may free its page {lock_delay_ms / 1000:.3f}s after the writer's liveness expiry or a "
            f"failed write's ack (lock_delay): raise the broker's --lock-delay to at least "
            f"{max_landing_ms / 1000:.3f}, or lower prefill's --mooncake-timeout, --landing-slack or "
            f"--max-write-bytes")


def landing_terms(timeout_s: int, max_write_bytes: int, slack_s: float) -> str:
    return (f"Mooncake timeout {timeout_s}s + 1 ns/byte of the largest batch call ({max_write_bytes} bytes, "
            f"--max-write-bytes) + --landing-slack {slack_s:.3f}s")


class WriteLeases:
    """Prefill's writes under the lease protocol's one timing inequality (docs/design.md §3, "One timing bound"):

        L = Mooncake timeout + 1 ns x bytes of the largest batch call + landing slack  <=  lock_delay

    checked at start-up (check_bounds) and by the broker on every BeginWrite (max_landing_s is L). Each call is
    posted only while this process's view of its liveness, which runs from the *send* of the BeginWrite or renewal,
    has liveness_margin_s or more left (check_alive), and EndWrite(success=false) goes out after the last call
    returned: design.md says why that keeps every byte out of a page the broker may free."""

    def __init__(self, broker, writer_prefix: str, max_landing_s: float, rpc_timeout_s: float = 10.0,
                 writer_ttl_s: float = 5.0, liveness_margin_s: float = 1.0,
                 landing_terms: str = "Mooncake timeout + 1 ns/byte of the largest batch call + --landing-slack"):
        if not 0 < liveness_margin_s < writer_ttl_s:
            raise ValueError(f"liveness margin {liveness_margin_s}s must be in (0, writer ttl {writer_ttl_s}s)")
        self.broker = broker
        self.writer_prefix = writer_prefix
        self.max_landing_s = max_landing_s
        self.landing_terms = landing_terms
        # the start-up check and every BeginWrite use the same whole milliseconds, so a bound that passes the one
        # can never be refused by the other
        self.max_landing_ms = math.ceil(max_landing_s * 1000)
        self.rpc_timeout_s = rpc_timeout_s
        self.writer_ttl_s = writer_ttl_s
        self.liveness_margin_s = liveness_margin_s
        self.terms = Terms("prefill")  # the newest broker term seen: an answer of an older one is refused
        self.renewals = Renewals(self)

    async def check_bounds(self) -> float:
        """At start-up: L <= lock_delay (the class docstring says why), in the whole milliseconds every BeginWrite
        declares; returns lock_delay. Raises TimingBoundError with both numbers."""
        resp = await call(self.broker.KeepAlive(broker_pb2.KeepAliveRequest(
            holder_id=f"{self.writer_prefix}/startup", ttl_ms=1000, term_seen=self.terms.newest),
            timeout=self.rpc_timeout_s), "broker KeepAlive")
        self.terms.check(resp.term, "KeepAlive")
        if (err := landing_bound_error(self.max_landing_s, resp.lock_delay_ms, self.landing_terms)) is not None:
            raise TimingBoundError(err)
        return resp.lock_delay_ms / 1000

    async def begin(self, pool_id: str, owner: bytes, epoch: int, leases_pb, writer_id: str,
                    deadline: float | None = None):
        """BeginWrite, which also starts the write's liveness lease (one call, not a KeepAlive before it);
        returns [liveness expiry], the renewal that keeps it from now on (a long forward pass must not let it
        lapse; one KeepAlive per interval renews every write of this process) and the pool's registered region.
        The call ends by the request's deadline (EndWrite, a give-back, never does)."""
        sent = time.monotonic()
        try:
            with GUARD_SECONDS.labels("begin_write_rpc").time():
                resp = await call(self.broker.BeginWrite(broker_pb2.BeginWriteRequest(
                    pool_id=pool_id, owner=owner, epoch=epoch, leases=leases_pb, writer_id=writer_id,
                    max_landing_ms=self.max_landing_ms, writer_ttl_ms=int(self.writer_ttl_s * 1000),
                    term_seen=self.terms.newest),
                    timeout=timeout_within(deadline, self.rpc_timeout_s, "before the broker's BeginWrite")),
                    "broker BeginWrite")
            self.terms.check(resp.term, "BeginWrite")  # before any post: an old term's authorisation is none
        except PdError as e:
            TRANSFER_FAILURES.labels("begin_write").inc()
            if e.reason in ("LEASE_NOT_CURRENT", "WRITER_ACTIVE", "LEASE_ALREADY_WRITTEN"):
                count_violation("prefill", e.reason, owner)
                raise PdError(grpc.StatusCode.DATA_LOSS, e.reason, e.message) from None
            # the broker restarted, or a new leader has not adopted the pool yet: retryable, as a restart is
            if e.reason in ("EPOCH_MISMATCH", "UNKNOWN_POOL", "POOL_FORGOTTEN", "POOL_EXPIRED"):
                raise PdError(grpc.StatusCode.UNAVAILABLE, e.reason, e.message) from None
            raise
        expires = [sent + self.writer_ttl_s]
        return expires, self.renewals.add(writer_id, epoch, resp.term, expires), resp.region

    async def end(self, pool_id, owner, epoch, leases_pb, writer_id: str, ok: bool, nothing_posted: bool,
                  coverage=None, first_token: int = 0, prompt_digest: bytes = b"") -> None:
        """coverage, first_token and the prompt's digest (of a successful write) go into the broker's write-done
        notice to decode."""
        if FAULTS.fire("prefill.lose_end_write", owner) is not None:
            return
        req = broker_pb2.EndWriteRequest(pool_id=pool_id, owner=owner, epoch=epoch, leases=leases_pb,
                                         writer_id=writer_id, success=ok, nothing_posted=nothing_posted and not ok,
                                         coverage=coverage if ok else None, first_token=first_token if ok else 0,
                                         prompt_digest=prompt_digest if ok else b"")
        for attempt in range(3):  # the acknowledgement matters: the pages stay quarantined without it
            try:
                with GUARD_SECONDS.labels("end_write_rpc").time():
                    await self.broker.EndWrite(req, timeout=self.rpc_timeout_s)
                return
            except grpc.RpcError as e:
                log.warning("EndWrite attempt %d for %s failed: %s", attempt + 1, owner.hex(), e)
                await asyncio.sleep(0.2 * (attempt + 1))
        TRANSFER_FAILURES.labels("end_write").inc()


class Renewals:
    """Renews the liveness of every running write of this process in one KeepAlive per interval (ttl / 3). A
    write leaves it when its call ends (renewal cancelled): a stuck write then stops being renewed and the broker
    presumes it dead at its expiry, while the rest of the process keeps serving."""

    def __init__(self, leases: WriteLeases):
        self.leases = leases
        # writer id -> (epoch, term of its BeginWrite, [expiry]): a write's liveness belongs to the term that began it,
        # so only a renewal answered under that term extends it (docs/design.md §3, "Leader failover")
        self.writes: dict[str, tuple[int, int, list[float]]] = {}
        self._task: asyncio.Task | None = None

    def add(self, writer_id: str, epoch: int, term: int, expires: list[float]) -> "Renewal":
        self.writes[writer_id] = (epoch, term, expires)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        return Renewal(self, writer_id)

    async def _run(self) -> None:
        while self.writes:
            await asyncio.sleep(self.leases.writer_ttl_s / 3)
            if not self.writes:
                return
            batch = dict(self.writes)
            ids = list(batch)
            sent = time.monotonic()
            try:
                resp = await call(self.leases.broker.KeepAlive(broker_pb2.KeepAliveRequest(
                    holder_id=ids[0], more_holder_ids=ids[1:], ttl_ms=int(self.leases.writer_ttl_s * 1000),
                    term_seen=self.leases.terms.newest), timeout=self.leases.rpc_timeout_s), "broker KeepAlive")
                self.leases.terms.check(resp.term, "KeepAlive")  # an old term's renewal extends nothing
            except PdError as e:
                log.warning("KeepAlive of %d writes failed: %s", len(ids), e)
                continue
            refused = set(resp.refused_holder_ids)
            for writer_id, (epoch, term, expires) in batch.items():
                if resp.term != term:
                    log.warning("writer %s: began under broker term %d, renewed under %d: not extended (it lapses "
                                "with its term's writers)", writer_id, term, resp.term)
                elif resp.epoch != epoch:
                    expires[0] = 0.0  # a new broker epoch: check_alive now refuses every further post
                    log.warning("writer %s: broker epoch is %#x, its leases are of %#x", writer_id, resp.epoch, epoch)
                elif writer_id in refused:
                    expires[0] = 0.0  # not renewed: check_alive refuses every further post at once
                    log.warning("KeepAlive of %s refused: its pool is fenced", writer_id)
                elif writer_id in self.writes:
                    expires[0] = sent + self.leases.writer_ttl_s


class Renewal:
    """One write's place in Renewals; cancel() when the write's call ends."""

    def __init__(self, renewals: Renewals, writer_id: str):
        self.renewals, self.writer_id = renewals, writer_id

    def cancel(self) -> None:
        self.renewals.writes.pop(self.writer_id, None)
