"""Decode's link to the broker: its pool incarnation (id, epoch, registration), liveness and the list of owners
it holds, broker restarts and moves (a new incarnation), and the revocation stream. An object the servicer
composes; it reaches the rest of decode only through the narrow `Holder` interface below.

Revocations come with a per-pool cursor (seq): decode resumes from the last one it processed, and after
any reconnect (or a gap the broker reports) re-checks every lease it reads with Validate, shares included. It counts as
blind from the last message of the stream (heartbeats included); blind longer than max_blind, it stops
stepping and fails what runs (UNAVAILABLE), since a revocation it cannot hear frees the pages after
lock_delay. Hence the start-up rule max_blind <= lock_delay / 2.

The KeepAlive's owner list is also decode's acknowledgement of a revocation: it names every owner whose pages
a step may still write (the step in flight included, however long it stalls), with the cursor of the revocations
decode had processed, and the broker frees a revoked owner's pages only lock_delay after a KeepAlive that no
longer names it and has seen its revocation (issue 18, hole 2).

A move to another broker incarnation (a new epoch, or the pool fenced or forgotten here) may leave the old
broker running, still accepting writes to the old pool until its reader record expires. So decode
registers a new pool incarnation and grants nothing from it until the fence the old broker announced
(reader_ttl + max writer ttl + lock_delay) has passed since decode's last contact with it, and the step in
flight (which may still write old pages) has ended."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import Protocol

import grpc

from ..common.broker_client import replicas
from ..common.errors import PdError, from_rpc_error
from ..common.metrics import HANDOVER_REQUESTS, HANDOVERS, LEASE_RECHECKS, TIMEOUTS
from ..common.proto import broker_pb2
from ..common.tasks import spawn
from ..common.terms import Terms
from ..common.wire import call, leases_to_pb
from .lease import LeaseClient
from .requests import RequestTable
from .run import GrantQueue, Notices
from .scheduler import Scheduler

log = logging.getLogger(__name__)


def blind_bound_error(max_blind_s: float, lock_delay_ms: int) -> str | None:
    """Why decode must not run with these bounds, or None."""
    if 0 < max_blind_s and max_blind_s * 1000 <= lock_delay_ms / 2:
        return None
    return (f"decode --max-blind {max_blind_s:g}s must be > 0 and <= half the broker's lock_delay "
            f"{lock_delay_ms / 1000:g}s (= {lock_delay_ms / 2000:g}s): a revocation decode cannot hear frees "
            f"its pages after lock_delay, and the step already running and the recheck need the other half")


class Holder(Protocol):
    """What the link needs of the rest of decode."""
    requests: RequestTable  # every request's state: allocations to end, sequences to mark
    scheduler: Scheduler  # the step loop: a move waits for its step in flight
    notices: Notices  # the Runs waiting for their write-done notice
    queue: GrantQueue  # the Runs waiting for pages: woken whenever the stream speaks

    def held_owners(self) -> set[bytes]: ...
    def region(self) -> broker_pb2.PoolRegion: ...
    async def release(self, owner: bytes, epoch: int, leases: list[tuple[int, int]]) -> None: ...


class BrokerWatch:
    def __init__(self, broker, holder: Holder, pool_id: str, num_pages: int, max_blind_s: float,
                 rpc_timeout_s: float):
        self.broker, self.holder = broker, holder
        self.pool_id, self.num_pages = pool_id, num_pages
        self.epoch = 0
        self.max_blind_s, self.rpc_timeout_s = max_blind_s, rpc_timeout_s
        self.epoch_changed = asyncio.Event()
        self.heard_at: float | None = None  # monotonic time of the last message on the revocation stream
        self.bound_error: str | None = None  # set when the broker's lock_delay breaks the blind bound
        self.watch_cursor = (0, 0)  # (epoch, seq) of the last revocation processed
        self.watching = asyncio.Event()  # set once the stream is first up
        self.contact_at: float | None = None  # monotonic time of the last reply of the broker
        self.fence_s = 0.0  # how long after contact_at a write it accepted may still land
        self.fenced_until = 0.0  # after a move: no grant from the new incarnation before this
        self.terms = Terms("decode")  # the newest broker term seen: an answer of an older one is refused
        # with replicas, a KeepAlive that a silent (paused) leader leaves unanswered moves on well within
        # max_blind; a standby refuses at once and the stub sends the call on to the leader
        self.keepalive_timeout_s = min(rpc_timeout_s, 1.0) if replicas(broker) > 1 else rpc_timeout_s
        self._resubscribe = asyncio.Event()  # set by a hand-over: the stream open is the old leader's
        self._handed_over = asyncio.Event()  # set (and replaced) at each hand-over kept
        self.leases = LeaseClient(broker, self, rpc_timeout_s)  # the re-check's Validate

    async def register(self, quarantined: list[int] = ()) -> int:
        resp = await call(self.broker.RegisterPool(broker_pb2.RegisterPoolRequest(
            pool_id=self.pool_id, num_pages=self.num_pages, quarantined_pages=quarantined,
            region=self.holder.region(), term_seen=self.terms.newest), timeout=self.rpc_timeout_s),
            "broker RegisterPool")
        self.terms.check(resp.term, "RegisterPool")
        self.epoch = resp.epoch
        self.check_lock_delay(resp.lock_delay_ms)
        self.contacted(resp.fence_ms)
        return self.epoch

    def contacted(self, fence_ms: int) -> None:
        self.contact_at, self.fence_s = time.monotonic(), fence_ms / 1000.0

    def check_lock_delay(self, lock_delay_ms: int) -> None:
        self.bound_error = blind_bound_error(self.max_blind_s, lock_delay_ms)
        if self.bound_error:
            log.error("%s; refusing to decode", self.bound_error)

    def blind_error(self) -> PdError | None:
        """The error every running or new request gets while decode cannot trust its revocation stream."""
        if self.bound_error:
            return PdError(grpc.StatusCode.UNAVAILABLE, "BAD_BOUNDS", self.bound_error)
        if (left := self.fenced_until - time.monotonic()) > 0:
            return PdError(grpc.StatusCode.UNAVAILABLE, "BROKER_FENCE",
                           f"pool {self.pool_id} moved to a new broker incarnation; the old one may accept writes "
                           f"to the old pool for {left:.2f}s more (fence {self.fence_s:g}s since the last contact)")
        blind_s = float("inf") if self.heard_at is None else time.monotonic() - self.heard_at
        if blind_s <= self.max_blind_s:
            return None
        return PdError(grpc.StatusCode.UNAVAILABLE, "WATCH_BLIND",
                       f"decode has not heard from the broker's revocation stream for {blind_s:.2f}s "
                       f"(bound --max-blind {self.max_blind_s:g}s); it stops rather than miss a revocation")

    async def watch_epoch(self, interval_s: float = 0.5, ttl_s: float = 5.0) -> None:
        """Keeps decode's liveness (and the list of owners it holds) with the broker and notices a broker
        restart (a new epoch): in-flight requests fail UNAVAILABLE (retryable) and the pages they held
        return through quarantine."""
        while True:
            try:
                await asyncio.wait_for(self.epoch_changed.wait(), interval_s)
            except asyncio.TimeoutError:
                pass
            self.epoch_changed.clear()
            try:
                # built in one step: every owner a step may still write is listed, the step in flight included,
                # and every revocation up to the cursor was processed, so the broker may take a revoked owner
                # missing here as stopped (hole 2)
                epoch, seen = self.watch_cursor
                resp = await self.broker.KeepAlive(broker_pb2.KeepAliveRequest(
                    holder_id=self.pool_id, ttl_ms=int(ttl_s * 1000), pool_id=self.pool_id,
                    held_owners=sorted(self.holder.held_owners()),
                    revocations_seen=seen if epoch == self.epoch else 0, term_seen=self.terms.newest),
                    timeout=self.keepalive_timeout_s)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    log.warning("broker unreachable (%s); running requests continue, new ones wait", e.code())
                    # soon again rather than at the next tick: with replicas, the next one may lead already
                    await asyncio.sleep(min(interval_s, 0.1))
                    self.epoch_changed.set()
                    continue
                why = f"pool {self.pool_id} is fenced or unknown at the broker: {e.details()}"
                if from_rpc_error(e).reason == "UNKNOWN_POOL" and await self.hand_over(why):
                    continue
                await self.move(why)
                continue
            if not self.terms.fresh(resp.term, "KeepAlive"):
                log.warning("a KeepAlive was answered under term %d, older than %d: ignored", resp.term,
                            self.terms.newest)
                continue
            self.check_lock_delay(resp.lock_delay_ms)
            if resp.epoch == self.epoch:
                self.contacted(resp.fence_ms)
                continue
            await self.move(f"the broker restarted or changed (epoch {self.epoch:#x} -> {resp.epoch:#x})")

    async def hand_over(self, why: str) -> bool:
        """The broker answering does not know the pool: if it is a new leader of the same epoch (a failover), hand
        the pool over with the requests that run, which go on (docs/design.md §3, "Leader failover"). Requests not
        yet running end (UNAVAILABLE, retryable): their prompt may still be written under the old term, and a
        write-done notice of it is lost. Returns False when the broker refuses (no election, another epoch): the
        caller moves to a new incarnation instead."""
        old_term = self.terms.newer_only()  # from here on, no answer of the old term changes what decode holds
        if old_term == 0:  # a broker without election restarted: nothing to hand over
            self.terms.any_term()
            return False
        requests = self.holder.requests
        err = PdError(grpc.StatusCode.UNAVAILABLE, "BROKER_FAILOVER",
                      f"{why}: the broker's leader changed before this request started decoding (its prompt may "
                      f"still be written under term {old_term}); retry")
        for owner, alloc in requests.end_allocations(err):
            spawn(self.holder.release(owner, alloc.epoch, alloc.leases))
        for seq in list(requests.joining.values()):
            requests.fail(seq.owner, err)
        self.holder.notices.lost(f"{why}: write-done notices of term {old_term} may be lost")
        claims = requests.claims()
        epoch, seen = self.watch_cursor
        try:
            resp = await call(self.broker.ClaimPool(broker_pb2.ClaimPoolRequest(
                pool_id=self.pool_id, num_pages=self.num_pages, region=self.holder.region(), epoch=self.epoch,
                term_seen=old_term, revocations_seen=seen if epoch == self.epoch else 0,
                owners=[o for o, _, _ in claims], num_leases=[len(leases) for _, leases, _ in claims],
                leases=leases_to_pb([lease for _, leases, _ in claims for lease in leases]),
                cached=[c for _, _, flags in claims for c in flags]), timeout=self.rpc_timeout_s), "broker ClaimPool")
            self.terms.check(resp.term, "ClaimPool")
        except PdError as e:
            HANDOVERS.labels("refused").inc()
            log.error("handing pool %s over from term %d failed: %s; registering a new incarnation", self.pool_id,
                      old_term, e)
            self.terms.any_term()
            return False
        HANDOVERS.labels("kept").inc()
        HANDOVER_REQUESTS.inc(len(claims))
        self.check_lock_delay(resp.lock_delay_ms)
        self.contacted(resp.fence_ms)
        self._resubscribe.set()
        self._handed_over.set()
        self._handed_over = asyncio.Event()
        log.warning("pool %s handed over from term %d to term %d: %d running requests go on", self.pool_id, old_term,
                    resp.term, len(claims))
        return True

    async def move(self, why: str) -> None:
        """Fails what runs (UNAVAILABLE, retryable) and registers a new pool incarnation, grantable only once
        the old broker must have fenced the old one and its writes have landed."""
        # every page, not only those in use: one released just before the move may still have an old write in
        # flight that no table remembers (found by the formal model)
        held = list(range(self.num_pages))
        if self.contact_at is not None:
            self.fenced_until = max(self.fenced_until, self.contact_at + self.fence_s)
        old_pool = self.pool_id
        self.pool_id = f"{old_pool.rsplit('-', 1)[0]}-{secrets.token_hex(4)}"
        requests = self.holder.requests
        log.error("%s: failing %d running requests; new pool incarnation %s, grantable in %.2fs", why,
                  len(requests.running), self.pool_id, max(0.0, self.fenced_until - time.monotonic()))
        err = PdError(grpc.StatusCode.UNAVAILABLE, "BROKER_RESTARTED", why)
        requests.fail_all(err)
        for owner, alloc in requests.end_allocations(err):
            spawn(self.holder.release(owner, alloc.epoch, alloc.leases))
        self.watch_cursor, self.heard_at = (0, 0), None
        # a step still running may write pages of the old incarnation: the new one starts after it
        await self.holder.scheduler.step_ended()
        try:
            epoch = await self.register(held)
            log.info("pool %s registered: %d pages, epoch %#x", self.pool_id, self.num_pages, epoch)
        except PdError as e:
            log.error("registering pool %s failed: %s", self.pool_id, e)

    async def handed_over(self, timeout_s: float) -> bool:
        """Waits for the next hand-over this decode keeps (a Grant refused UNKNOWN_POOL by a new leader that has
        not adopted the pool yet); False after timeout_s."""
        try:
            await asyncio.wait_for(self._handed_over.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def watch_revocations(self, retry_s: float = 0.2) -> None:
        """A revoked request stops before its next step; none is lost across a reconnect. A hand-over leaves the
        stream open to the old leader (silent if it is paused): it is dropped, and the next goes to the new one."""
        while True:
            epoch, seq = self.watch_cursor
            pool_id = self.pool_id
            stream = self.broker.WatchRevocations(broker_pb2.WatchRevocationsRequest(
                pool_id=pool_id, after_seq=seq, epoch=epoch, term_seen=self.terms.newest))
            self._resubscribe.clear()
            consume = asyncio.ensure_future(self._consume(stream, pool_id))
            again = asyncio.ensure_future(self._resubscribe.wait())
            try:
                await asyncio.wait({consume, again}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                again.cancel()
                if not consume.done():
                    stream.cancel()
                    consume.cancel()
                    with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
                        await consume
            await asyncio.sleep(retry_s)

    async def _consume(self, stream, pool_id: str) -> None:
        is_new_stream = True
        try:
            async for msg in stream:
                if pool_id != self.pool_id or not self.terms.fresh(msg.term, "WatchRevocations"):
                    # the old incarnation's stream, or a replica whose term ended, must not count as hearing the
                    # broker
                    stream.cancel()
                    break
                if msg.heartbeat:
                    await self._on_heartbeat(msg, is_new_stream)
                    is_new_stream = False
                    continue
                self.heard_at = time.monotonic()
                if msg.write_done:
                    self.holder.notices.on_notice(msg)
                    self.watch_cursor = (msg.epoch, msg.seq)
                else:
                    self._on_revocation(msg)
                self.holder.queue.pages_may_be_free()
        except grpc.RpcError as e:
            log.warning("revocation stream ended (%s); resubscribing after seq %s", e.code(), self.watch_cursor)

    def _on_revocation(self, msg) -> None:
        err = PdError(grpc.StatusCode.DATA_LOSS, "REVOKED", f"the broker revoked this request's leases: {msg.reason}")
        if self.holder.requests.end_allocation(msg.owner, err) is not None:
            # the broker ended these leases itself: nothing to release
            log.warning("allocation %s revoked before its Decode: %s", msg.owner.hex(), msg.reason)
        self.holder.requests.revoke(msg.owner, err)
        self.watch_cursor = (msg.epoch, msg.seq)

    async def _on_heartbeat(self, msg, is_new_stream: bool) -> None:
        if msg.gap or msg.seq > self.watch_cursor[1] and msg.epoch == self.watch_cursor[0]:
            # revocations were missed: nothing may be trusted until every lease read is re-checked
            log.error("revocation stream of pool %s lost revocations (cursor %s, broker at seq %s): "
                      "re-checking every running lease", self.pool_id, self.watch_cursor, msg.seq)
            self.holder.notices.lost(f"the broker's stream of pool {self.pool_id} lost events after seq "
                                     f"{self.watch_cursor[1]}; a write-done notice may be among them")
            await self.recheck_leases()
        elif is_new_stream:
            self.heard_at = time.monotonic()  # the replay brought everything missed
            await self.recheck_leases()
        self.heard_at = time.monotonic()
        self.watch_cursor = (msg.epoch, msg.seq)
        self.watching.set()
        self.holder.queue.pages_may_be_free()

    async def recheck_leases(self) -> None:
        """Re-checks every running and joining request's leases, exactly what it holds: its own pages as LEASED to
        it, the pages it shares or published as CACHED with it among the readers (ValidateRequest.recheck). A lease
        the broker ended fails its request closed (DATA_LOSS, a lease violation); a check that cannot be made ends
        it UNAVAILABLE (retryable), counted as what it is: nothing was found wrong."""
        requests = self.holder.requests
        # one already ending (a revocation the replay brought, a cancellation) is not asked about again
        seqs = [s for s in requests.sequences() if not s.cancelled]
        results = await asyncio.gather(*(self.leases.recheck(s.owner, s.epoch, s.leases) for s in seqs),
                                       return_exceptions=True)
        for seq, result in zip(seqs, results):
            if not isinstance(result, Exception):
                LEASE_RECHECKS.labels("current").inc()
                continue
            if isinstance(result, PdError) and result.code == grpc.StatusCode.FAILED_PRECONDITION:
                # OWNER_RELEASED: it finished while its re-check was on its way, and decode gave its pages back (no
                # alarm); were it somehow still running, it ends closed all the same
                outcome = "released" if result.reason == "OWNER_RELEASED" else "not_current"
                LEASE_RECHECKS.labels(outcome).inc()
                if outcome == "not_current":
                    log.warning("request %s failed its lease re-check: %s", seq.owner.hex(), result)
                requests.revoke(seq.owner, PdError(
                    grpc.StatusCode.DATA_LOSS, "REVOKED",
                    f"re-checked after a revocation-stream outage: {result.reason}: {result.message}"))
            else:  # the check could not be made: fail closed, retryable
                log.warning("request %s could not be re-checked: %s", seq.owner.hex(), result)
                LEASE_RECHECKS.labels("unreachable").inc()
                requests.fail(seq.owner, PdError(
                    grpc.StatusCode.UNAVAILABLE, "RECHECK_FAILED",
                    f"the broker did not answer decode's lease re-check after a revocation-stream outage "
                    f"(timeout {self.rpc_timeout_s:g}s): {result}"))

    async def expire_allocations(self, interval_s: float = 1.0) -> None:
        """Allocations whose Decode never came (prefill failed, gateway gone) end at their deadline; should
        the Release fail, the broker's reconciliation ends the leases (the owner is no longer held)."""
        while True:
            await asyncio.sleep(interval_s)
            # popped in one step before any await: one that Decode or Run takes meanwhile is not among them
            for owner, alloc in self.holder.requests.expire():
                TIMEOUTS.labels("allocation").inc()
                log.warning("allocation %s expired without a Decode call; releasing", owner.hex())
                await asyncio.shield(self.holder.release(owner, alloc.epoch, alloc.leases))
