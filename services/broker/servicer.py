"""gRPC face of the lease table: translates messages and errors, publishes metrics, feeds revocation watchers."""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable, TypeVar

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from pdserve.broker.authority import SoleAuthority, TermOverlapError
from pdserve.broker.election import RETRYABLE, NotLeaderError
from pdserve.broker.lease_table import LeaseError, LeaseTable
from pdserve.broker.watch_stream import revocation_stream
from pdserve.common.errors import PdError, abort
from pdserve.common.faults import FAULTS
from pdserve.common.proto import broker_pb2, broker_pb2_grpc, common_pb2
from pdserve.common.tasks import spawn

log = logging.getLogger(__name__)
T = TypeVar("T")

_CODES = {
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "FAILED_PRECONDITION": grpc.StatusCode.FAILED_PRECONDITION,
    "NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "ALREADY_EXISTS": grpc.StatusCode.ALREADY_EXISTS,
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
}
# refusals of a lease check that put no page at stake: the request had already ended at its decode, was granted by an
# earlier leader and not handed over (decode ended it at the failover), or names a pool this broker does not know (a
# new leader before the hand-over, a forgotten pool): the broker gives no region to write to for it
NO_VIOLATION = frozenset({"OWNER_RELEASED", "EARLIER_TERM_LEASE", "UNKNOWN_POOL", "POOL_FORGOTTEN"})
# created up front so a dashboard shows 0, not "no data", before the first violation
_VIOLATION_REASONS = ("EPOCH_MISMATCH", "LEASE_NOT_CURRENT", "WRITER_ACTIVE", "LEASE_ALREADY_WRITTEN",
                      "LANDING_BOUND_EXCEEDS_LOCK_DELAY")
_PAGE_STATES = ("free", "leased", "quarantined", "cached")
_CACHE_STATES = ("read", "unread")  # unread: what a short Grant or Extend may evict
_EVICTION_REASONS = ("lru", "corrupt")


def _leases(msgs) -> list[tuple[int, int]]:
    return [(m.page, m.generation) for m in msgs]


class BrokerServicer(broker_pb2_grpc.BrokerServicer):
    def __init__(self, table: LeaseTable, registry: CollectorRegistry = REGISTRY, heartbeat_s: float = 0.25,
                 authority=None, free_set=None):
        """authority: whether this process may answer now, and its term (authority.py); alone by default.
        free_set: a replica under election keeps its pools' durable free sets in etcd (free_set.py)."""
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat interval {heartbeat_s}s must be > 0")
        self._table = table
        self._authority = authority or SoleAuthority()
        self._free_set = free_set
        self._heartbeat_s = heartbeat_s
        self._watchers: dict[str, set[asyncio.Event]] = {}  # pool -> one wake-up per open stream
        self.stopping = False  # set on SIGTERM: a successor may already run, so nothing new is accepted
        self._pages = Gauge("pdserve_kv_pages", "KV pages of a decode pool by broker state",
                            ["pool", "state"], registry=registry)
        self._violations = Counter("pdserve_lease_violations_total", "Refused lease checks",
                                   ["service", "reason"], registry=registry)
        self._grants = Counter("pdserve_broker_grants_total", "Successful page grants", registry=registry)
        # TERM_OVERLAP: a caller had seen a newer term while this replica's own clock said it still led; the
        # authority bound exists so that it never happens
        self._refused = Counter("pdserve_broker_not_leader_total", "Calls refused because this replica may not "
                                "authorise (NOT_LEADER) or a caller has seen a newer term (TERM_OVERLAP)",
                                ["reason"], registry=registry)
        self._cache_pages = Gauge("pdserve_prefix_cache_pages", "Cached prefix pages of a decode pool: read (by "
                                  "an owner, or pinned by a revoked one) or unread", ["pool", "state"],
                                  registry=registry)
        self._shared_reads = Gauge("pdserve_prefix_cache_shared_reads", "Reader shares of cached pages, summed over "
                                   "the pages of a decode pool (0 at quiescence)", ["pool"], registry=registry)
        self._hits = Counter("pdserve_prefix_cache_hits_total", "Cached pages shared by Grants", ["service"],
                             registry=registry)
        self._published = Counter("pdserve_prefix_cache_published_total", "Pages Publish made cached",
                                  registry=registry)
        self._evictions = Counter("pdserve_prefix_cache_evictions_total", "Cached pages taken out of the cache "
                                  "(lru: unread, for a short Grant or Extend; corrupt: unpublished by a reader)",
                                  ["reason"], registry=registry)
        # a chain cached under another scope's tag: never shared, and it should never happen
        self._cross_scope = Counter("pdserve_prefix_cache_cross_scope_total", "Chain matches under another "
                                    "prefix scope, refused", ["service"], registry=registry)
        for reason in _VIOLATION_REASONS:
            self._violations.labels("broker", reason)
        self._adopted = Counter("pdserve_broker_leases_adopted_total", "Page leases kept across a failover: decode "
                                "handed them over to this leader", registry=registry)
        self._drained_at_handover = Counter("pdserve_broker_handover_quarantined_pages_total", "Pages nobody claimed "
                                            "at a failover, quarantined until the earlier term's writes drained",
                                            registry=registry)
        for reason in ("NOT_LEADER", "TERM_OVERLAP"):
            self._refused.labels(reason)
        self._hits.labels("broker")
        self._cross_scope.labels("broker")
        for reason in _EVICTION_REASONS:
            self._evictions.labels(reason)
        for pool_id in table.pool_ids():
            self._publish(pool_id)

    async def RegisterPool(self, request: broker_pb2.RegisterPoolRequest,
                           context: grpc.aio.ServicerContext) -> broker_pb2.RegisterPoolResponse:
        await self._refuse_if_stopping(context, "RegisterPool")
        region = request.region
        if not region.transfer_session or not region.data_base or not region.tag_base:
            await abort(context, PdError(grpc.StatusCode.INVALID_ARGUMENT, "BAD_REGION",
                                         f"pool {request.pool_id!r} names no transfer session or base address"))
        epoch = await self._call(context, self._table.register_pool, request.pool_id, request.num_pages,
                                 list(request.quarantined_pages), region, term_seen=request.term_seen)
        self._publish(request.pool_id)
        log.info("pool %s registered with %s pages in epoch %s", request.pool_id, request.num_pages, epoch)
        return broker_pb2.RegisterPoolResponse(epoch=epoch, lock_delay_ms=self._lock_delay_ms(),
                                               fence_ms=self._fence_ms(), term=self._authority.term)

    async def ClaimPool(self, request: broker_pb2.ClaimPoolRequest,
                        context: grpc.aio.ServicerContext) -> broker_pb2.RegisterPoolResponse:
        await self._refuse_if_stopping(context, "ClaimPool")
        if sum(request.num_leases) != len(request.leases) or len(request.cached) != len(request.leases) \
                or len(request.num_leases) != len(request.owners):
            await abort(context, PdError(grpc.StatusCode.INVALID_ARGUMENT, "BAD_CLAIM",
                                         f"{len(request.owners)} owners, {len(request.num_leases)} lease counts "
                                         f"summing to {sum(request.num_leases)}, {len(request.leases)} leases, "
                                         f"{len(request.cached)} cached flags"))
        claims, at = [], 0
        for owner, n in zip(request.owners, request.num_leases):
            claims.append((owner, _leases(request.leases[at:at + n]), list(request.cached[at:at + n])))
            at += n
        parked: set[int] = set()
        if self._free_set is not None:
            try:
                parked = await self._free_set.load(request.pool_id, request.num_pages)
            except ValueError as e:
                await abort(context, PdError(grpc.StatusCode.FAILED_PRECONDITION, "BAD_CLAIM", str(e)))
            except RETRYABLE as e:
                await abort(context, PdError(grpc.StatusCode.UNAVAILABLE, "ETCD_UNAVAILABLE",
                                             f"reading the durable free set of pool {request.pool_id}: {e!r}"))
        epoch = await self._call(context, self._table.adopt_pool, request.pool_id, request.num_pages,
                                 request.region, request.epoch, request.term_seen, request.revocations_seen, claims,
                                 parked, term_seen=request.term_seen)
        self._adopted.inc(len(request.leases))
        self._publish(request.pool_id)
        state = self._table.pool_state(request.pool_id)
        self._drained_at_handover.inc(state["num_quarantined"])
        log.warning("pool %s adopted from term %d: %d owners, %d leases kept; %d pages wait for the earlier term's "
                    "writes to drain", request.pool_id, request.term_seen, len(claims), len(request.leases),
                    state["num_quarantined"])
        return broker_pb2.RegisterPoolResponse(epoch=epoch, lock_delay_ms=self._lock_delay_ms(),
                                               fence_ms=self._fence_ms(), term=self._authority.term)

    async def Grant(self, request: broker_pb2.GrantRequest,
                    context: grpc.aio.ServicerContext) -> broker_pb2.GrantResponse:
        await self._refuse_if_stopping(context, "Grant")
        if self._free_set is not None:
            await self._free_set.ensure(request.pool_id, request.num_pages)
        leases, num_shared, checksums = await self._call(
            context, self._table.grant_with_prefix, request.pool_id, request.owner, request.num_pages,
            request.epoch, list(request.prefix_chains), request.scope_tag, term_seen=request.term_seen)
        self._grants.inc()
        self._publish(request.pool_id)
        if FAULTS.fire("broker.lose_grant_reply", request.owner) is not None:
            await abort(context, PdError(grpc.StatusCode.UNAVAILABLE, "FAULT_LOST_REPLY",
                                         f"fault point: the grant to {request.owner.hex()} happened, its reply is lost"))
        return broker_pb2.GrantResponse(
            epoch=self._table.epoch, leases=[common_pb2.PageLease(page=p, generation=g) for p, g in leases],
            num_shared=num_shared, shared_checksums=checksums, term=self._authority.term)

    async def Publish(self, request: broker_pb2.PublishRequest,
                      context: grpc.aio.ServicerContext) -> broker_pb2.PublishResponse:
        await self._refuse_if_stopping(context, "Publish")
        published = await self._call(context, self._table.publish, request.pool_id, request.owner, request.epoch,
                                     _leases(request.leases), list(request.chains), list(request.checksums),
                                     request.scope_tag)
        self._publish(request.pool_id)
        return broker_pb2.PublishResponse(published=published, term=self._authority.term)

    async def Unpublish(self, request: broker_pb2.UnpublishRequest,
                        context: grpc.aio.ServicerContext) -> broker_pb2.UnpublishResponse:
        # not refused while stopping: it only takes pages out of the cache
        num = await self._call(context, self._table.unpublish, request.pool_id, request.owner, request.epoch,
                               _leases(request.leases), request.reason)
        self._publish(request.pool_id)
        return broker_pb2.UnpublishResponse(num_unpublished=num, term=self._authority.term)

    async def Extend(self, request: broker_pb2.ExtendRequest,
                     context: grpc.aio.ServicerContext) -> broker_pb2.ExtendResponse:
        await self._refuse_if_stopping(context, "Extend")
        if len(request.owners) != len(request.num_pages):
            await abort(context, PdError(grpc.StatusCode.INVALID_ARGUMENT, "BAD_EXTEND",
                                         f"{len(request.owners)} owners but {len(request.num_pages)} page counts"))
        if self._free_set is not None:
            await self._free_set.ensure(request.pool_id, sum(request.num_pages))
        results = await self._call(context, self._table.extend, request.pool_id, request.epoch,
                                   list(zip(request.owners, request.num_pages)), term_seen=request.term_seen)
        out = broker_pb2.ExtendResponse(epoch=self._table.epoch, term=self._authority.term)
        for r in results:
            if isinstance(r, LeaseError):
                out.results.add(refused=r.reason, message=r.message)
            else:
                out.results.add(leases=[common_pb2.PageLease(page=p, generation=g) for p, g in r])
                self._grants.inc()
        self._publish(request.pool_id)
        return out

    async def BeginWrite(self, request: broker_pb2.BeginWriteRequest,
                         context: grpc.aio.ServicerContext) -> broker_pb2.BeginWriteResponse:
        await self._refuse_if_stopping(context, "BeginWrite")
        region = await self._call(context, self._table.begin_write, request.pool_id, request.owner, request.epoch,
                                  _leases(request.leases), request.writer_id, request.max_landing_ms / 1000.0,
                                  request.writer_ttl_ms / 1000.0, checked_owner=request.owner,
                                  term_seen=request.term_seen)
        return broker_pb2.BeginWriteResponse(region=region, term=self._authority.term)

    async def EndWrite(self, request: broker_pb2.EndWriteRequest,
                       context: grpc.aio.ServicerContext) -> broker_pb2.EndWriteResponse:
        cov = request.coverage
        written = (cov.num_tokens, tuple(cov.checksums), request.first_token, request.prompt_digest) \
            if request.HasField("coverage") else None
        last_seq = self._last_seq(request.pool_id)
        num = await self._call(context, self._table.end_write, request.pool_id, request.owner, request.epoch,
                               _leases(request.leases), request.writer_id, request.success,
                               request.nothing_posted, written)
        if self._last_seq(request.pool_id) != last_seq:
            self._after_revoke(request.pool_id)  # a write-done notice: wake the pool's watchers
        if not request.success:
            log.info("writer %s reported a failed write of %s pages in pool %s (%s)", request.writer_id,
                     len(request.leases), request.pool_id,
                     "nothing posted" if request.nothing_posted else f"held for lock_delay {self._table.lock_delay_s}s")
        self._publish(request.pool_id)
        return broker_pb2.EndWriteResponse(num_unquarantined=num, term=self._authority.term)

    async def Validate(self, request: broker_pb2.ValidateRequest,
                       context: grpc.aio.ServicerContext) -> broker_pb2.ValidateResponse:
        await self._call(context, self._table.validate, request.pool_id, request.owner, request.epoch,
                         _leases(request.leases), request.recheck, checked_owner=request.owner,
                         term_seen=request.term_seen)
        return broker_pb2.ValidateResponse(term=self._authority.term)

    async def Release(self, request: broker_pb2.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> broker_pb2.ReleaseResponse:
        freed, quarantined = await self._call(context, self._table.release, request.pool_id, request.owner,
                                              request.epoch)
        self._publish(request.pool_id)
        return broker_pb2.ReleaseResponse(num_freed=freed, num_quarantined=quarantined, term=self._authority.term)

    async def KeepAlive(self, request: broker_pb2.KeepAliveRequest,
                        context: grpc.aio.ServicerContext) -> broker_pb2.KeepAliveResponse:
        await self._refuse_if_stopping(context, "KeepAlive")
        await self._call(context, self._table.keep_alive, request.holder_id, request.ttl_ms / 1000.0,
                         term_seen=request.term_seen)
        refused = await self._call(context, self._table.keep_alive_many, list(request.more_holder_ids),
                                   request.ttl_ms / 1000.0) if request.more_holder_ids else []
        # a pool this incarnation does not know (it restarted) or has fenced: NOT_FOUND, and decode
        # registers a new incarnation
        if request.pool_id:
            stale = await self._call(context, self._table.reader_keep_alive, request.pool_id, request.held_owners,
                                     request.revocations_seen)
            if stale:
                log.warning("pool %s: revoked %d owners its decode no longer holds", request.pool_id, len(stale))
                self._after_revoke(request.pool_id)
        return broker_pb2.KeepAliveResponse(epoch=self._table.epoch, lock_delay_ms=self._lock_delay_ms(),
                                            fence_ms=self._fence_ms(), refused_holder_ids=refused,
                                            term=self._authority.term)

    async def WatchRevocations(self, request: broker_pb2.WatchRevocationsRequest,
                               context: grpc.aio.ServicerContext) -> AsyncIterator[broker_pb2.Revocation]:
        await self._call(context, self._table.pool_state, request.pool_id, term_seen=request.term_seen)
        after_seq = request.after_seq if request.epoch == self._table.epoch else 0
        wake = asyncio.Event()
        watchers = self._watchers.setdefault(request.pool_id, set())
        watchers.add(wake)
        try:
            async for msg in revocation_stream(self._table, request.pool_id, after_seq, wake, self._heartbeat_s,
                                               self._authorise):
                yield msg
        finally:
            watchers.discard(wake)
            if not watchers:  # one entry per pool ever watched would grow across decode restarts
                self._watchers.pop(request.pool_id, None)

    async def Revoke(self, request: broker_pb2.RevokeRequest,
                     context: grpc.aio.ServicerContext) -> broker_pb2.ReleaseResponse:
        freed, quarantined = await self._call(context, self.revoke, request.pool_id, request.owner,
                                              request.reason or "OPERATOR")
        return broker_pb2.ReleaseResponse(num_freed=freed, num_quarantined=quarantined, term=self._authority.term)

    async def GetPoolState(self, request: broker_pb2.GetPoolStateRequest,
                           context: grpc.aio.ServicerContext) -> broker_pb2.GetPoolStateResponse:
        state = await self._call(context, self._table.pool_state, request.pool_id)
        return broker_pb2.GetPoolStateResponse(**state)

    def revoke(self, pool_id: str, owner: bytes, reason: str) -> tuple[int, int]:
        """Ends an owner's leases on the broker's own initiative and tells the pool's watchers."""
        counts = self._table.revoke(pool_id, owner, reason)
        self._after_revoke(pool_id)
        return counts

    async def run_sweeper(self, interval_s: float) -> None:
        """Frees pages of writers presumed dead, every interval_s, until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                num_freed = self._table.sweep()
                for pool_id in self._table.pool_ids():  # the sweep also revokes the leases of expired readers
                    self._after_revoke(pool_id)
                self.forget_pools()
            except Exception:  # a dead sweeper would leak every quarantined page: log and keep going
                log.exception("sweep failed")
                continue
            if num_freed:
                log.warning("sweeper freed %s quarantined pages of writers presumed dead", num_freed)

    def forget_pools(self) -> list[str]:
        """Drops fenced, drained pools and their metric series (one set per decode incarnation otherwise)."""
        gone = self._table.forget_pools()
        for pool_id in gone:
            if self._free_set is not None:
                spawn(self._free_set.forget(pool_id))
            self._drop_series(pool_id)
            for wake in self._watchers.get(pool_id, ()):
                wake.set()  # its streams end with NOT_FOUND
            log.info("pool %s forgotten: its decode stopped renewing it %.1fs+ ago and no page is held",
                     pool_id, self._table.reader_ttl_s + self._table.lock_delay_s)
        return gone

    def reset(self, table: LeaseTable, authority, free_set=None) -> None:
        """A term this replica led is over: every call from now on goes to a fresh table and authority (which
        follow until the next term won), the old pools' series go, and their streams wake to end (the old
        authority refuses their next message)."""
        old = self._table.pool_ids()
        self._table, self._authority, self._free_set = table, authority, free_set
        for pool_id in old:
            self._drop_series(pool_id)
        for wakes in list(self._watchers.values()):
            for wake in wakes:
                wake.set()

    def _drop_series(self, pool_id: str) -> None:
        for gauge, labels in [*((self._pages, (pool_id, n)) for n in _PAGE_STATES),
                              *((self._cache_pages, (pool_id, n)) for n in _CACHE_STATES),
                              (self._shared_reads, (pool_id,))]:
            try:
                gauge.remove(*labels)
            except KeyError:
                pass

    def stop_accepting(self) -> None:
        self.stopping = True
        log.warning("broker stopping: refusing RegisterPool, Grant, Publish, BeginWrite and KeepAlive from now on")

    async def _refuse_if_stopping(self, context: grpc.aio.ServicerContext, method: str) -> None:
        if self.stopping:
            await abort(context, PdError(grpc.StatusCode.UNAVAILABLE, "BROKER_STOPPING",
                                         f"{method} refused: this broker (epoch {self._table.epoch:#x}) is stopping; "
                                         "its successor takes over"))

    def _last_seq(self, pool_id: str) -> int:
        return self._table.last_seq(pool_id) if pool_id in self._table.pool_ids() else 0

    def _fence_ms(self) -> int:
        return round(self._table.fence_s * 1000)

    def num_watchers(self, pool_id: str) -> int:
        return len(self._watchers.get(pool_id, ()))

    def _after_revoke(self, pool_id: str) -> None:
        self._publish(pool_id)
        for wake in self._watchers.get(pool_id, ()):
            wake.set()

    def _lock_delay_ms(self) -> int:
        return round(self._table.lock_delay_s * 1000)

    def _publish(self, pool_id: str) -> None:
        """After a call that may have changed the pool: its metrics, and the balance of its durable free set."""
        if pool_id not in self._table.pool_ids():
            return  # a stale call naming a pool of an earlier incarnation: nothing here to publish
        if self._free_set is not None:
            self._free_set.poke(pool_id)
        state = self._table.pool_state(pool_id)
        for name in _PAGE_STATES:
            self._pages.labels(pool_id, name).set(state[f"num_{name}"])
        num_unread = self._table.num_unread_cached(pool_id)
        self._cache_pages.labels(pool_id, "unread").set(num_unread)
        self._cache_pages.labels(pool_id, "read").set(state["num_cached"] - num_unread)
        self._shared_reads.labels(pool_id).set(state["num_shared_reads"])

    def _count_prefix_events(self) -> None:
        counts = self._table.take_prefix_counts()
        self._hits.labels("broker").inc(counts["hits"])
        self._published.inc(counts["published"])
        self._cross_scope.labels("broker").inc(counts["cross_scope"])
        for reason in _EVICTION_REASONS:
            self._evictions.labels(reason).inc(counts[f"evicted_{reason}"])

    def _authorise(self, term_seen: int = 0) -> int:
        """This replica's term if it may answer now, else PdError UNAVAILABLE NOT_LEADER (counted)."""
        try:
            return self._authority.check(term_seen)
        except NotLeaderError as e:
            self._refused.labels("TERM_OVERLAP" if isinstance(e, TermOverlapError) else "NOT_LEADER").inc()
            raise PdError(grpc.StatusCode.UNAVAILABLE, "NOT_LEADER", str(e).removeprefix("NOT_LEADER: ")) from None

    async def _call(self, context: grpc.aio.ServicerContext, fn: Callable[..., T], *args,
                    checked_owner: bytes | None = None, term_seen: int = 0) -> T:
        """Runs fn on the table if this replica may answer now, with no await between the check and the act.
        checked_owner: the call is a lease check of this owner's leases, and a refusal counts as a violation."""
        try:
            self._authorise(term_seen)
        except PdError as e:
            await abort(context, e)
            raise
        try:
            return fn(*args)
        except LeaseError as e:
            # counted before the caller hears the refusal (a refused Grant too may have met a chain cached under
            # another scope): abort() sends the status, and a caller that reads the counter next must see it
            self._count_prefix_events()
            if checked_owner is not None and e.reason not in NO_VIOLATION:
                self._violations.labels("broker", e.reason).inc()
                FAULTS.counted("broker", e.reason, checked_owner)
                log.warning("lease check refused: %s %s", e.reason, e.message)
            await abort(context, PdError(_CODES[e.kind], e.reason, e.message))
            raise  # abort() raises; this only keeps the return type honest
        finally:
            self._count_prefix_events()
