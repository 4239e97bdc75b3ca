"""The broker replicas' leader election on etcd, with a fencing term and a bound on the leader's authority.

Life cycle of a replica (`docs/design.md` §3, "Leader failover"):
1. Campaign: grant an etcd lease of `ttl` seconds, then one transaction: if the election key does not exist
   (`create_revision == 0`), put this replica's identity and address under that lease. The key's create revision
   is the **term**: etcd's revisions only grow, so every later leader's term is greater, and anyone learns the
   leader and its term with one Get (`read_leader`).
2. Follow (the key exists): remember the leader, watch the key, campaign again once it is deleted.
3. Lead: renew the lease every ttl/3 and authorise only while `now < authority_until` (A8), where
   `authority_until = (send time of the last renewal etcd answered) + ttl - margin` on this process's monotonic
   clock. etcd expires the lease no earlier than ttl after it *received* that renewal, which is after we sent it,
   so this replica's authority has ended before etcd can delete the key and elect another (clock rates agreeing
   within the margin). The key is deleted only by etcd at the lease's expiry or by its own leader on resign.
4. Lose: the lease is gone (a renewal answered ttl 0), or the key was deleted or re-created: the term is over;
   back to 1. A replica paused past its ttl wakes with `authorised()` already false, since that reads the clock.
5. Resign on stop: stop authorising, delete the key if it still has our term, revoke the lease, so another
   replica leads at once instead of after a ttl.

Durable state the leader writes goes through `txn_in_term`: a transaction conditioned on the key's create revision
being the writer's term, so a write from a term that has ended fails in etcd itself, whatever its writer believes.
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aetcd
import grpc
from aetcd import exceptions as etcd_errors
from aetcd import rpc as etcd_rpc
from aetcd import watcher as etcd_watcher
from aetcd.rtypes import EventKind

log = logging.getLogger(__name__)

# what an unreachable or leaderless etcd raises: the loops retry after a backoff, authority decays by itself
RETRYABLE = (etcd_errors.ClientError, asyncio.TimeoutError, OSError)


def election_key(cluster: str) -> bytes:
    return f"/pdserve/{cluster}/broker/leader".encode()


class TlsClient(aetcd.Client):
    """aetcd's client over a channel with mutual TLS (aetcd itself only speaks plaintext): the same stubs and
    watcher on a secure channel. `server_name`: the name etcd's certificate carries, when the target is not it."""

    def __init__(self, *args, credentials, server_name: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._credentials, self._server_name = credentials, server_name

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        options = [*self._options.items()]
        if self._server_name:
            options.append(("grpc.ssl_target_name_override", self._server_name))
        self.channel = grpc.aio.secure_channel(f"{self._host}:{self._port}", self._credentials, options=options)
        self.kvstub, self.clusterstub = etcd_rpc.KVStub(self.channel), etcd_rpc.ClusterStub(self.channel)
        self.leasestub, self.maintenancestub = etcd_rpc.LeaseStub(self.channel), etcd_rpc.MaintenanceStub(self.channel)
        self._watcher = etcd_watcher.Watcher(etcd_rpc.WatchStub(self.channel), timeout=self._timeout,
                                             metadata=self.metadata)
        self._connected.set()


def connect(endpoints: Sequence[str], timeout: float = 2.0, credentials=None,
            server_name: str | None = None) -> aetcd.Client:
    """An etcd client for `endpoints` ("host:port"), over mutual TLS with `credentials` (grpc channel credentials)
    when given. aetcd takes one host and port, which it joins into a gRPC target; several endpoints (IP literals)
    become one `ipv4:` target with every address, so gRPC's pick_first moves to another member when the one it
    talks to goes away."""
    if not endpoints:
        raise ValueError("no etcd endpoints")

    def client(host: str, port: int) -> aetcd.Client:
        if credentials is None:
            return aetcd.Client(host=host, port=port, timeout=timeout)
        return TlsClient(host=host, port=port, timeout=timeout, credentials=credentials, server_name=server_name)
    if len(endpoints) == 1:
        host, _, port = endpoints[0].rpartition(":")
        return client(host, int(port))
    for e in endpoints:
        try:
            ipaddress.IPv4Address(e.rpartition(":")[0])
        except ValueError:
            raise ValueError(f"several etcd endpoints must be IPv4 address:port (one gRPC ipv4: target), got {e!r}; "
                             "give a DNS name with several addresses as the one endpoint instead") from None
    head, _, port = ",".join(endpoints).rpartition(":")
    return client(f"ipv4:{head}", int(port))


@dataclass(slots=True, frozen=True)
class Leader:
    """Who leads, as the election key says: anyone may read it (`read_leader`)."""
    identity: str
    address: str
    term: int

    @classmethod
    def from_kv(cls, value: bytes, create_revision: int) -> Leader:
        try:
            d = json.loads(value)
            return cls(str(d["identity"]), str(d["address"]), create_revision)
        except (ValueError, KeyError, TypeError):
            return cls(f"<unreadable {value[:40]!r}>", "", create_revision)


@dataclass(slots=True, frozen=True)
class ElectionState:
    """One replica's view, for metrics and health: `term` is its own while it leads, else the known leader's."""
    is_leader: bool
    term: int
    leader: Leader | None
    authority_left_s: float
    terms_won: int
    # on this process's monotonic clock, for its own latest term: the send of the transaction that won it (etcd
    # elected us after this) and the latest instant its authority could reach (etcd elects no other before it)
    term_since: float
    authority_until: float


class NotLeaderError(Exception):
    """This replica may not authorise: reason NOT_LEADER, the message says why with the numbers."""
    reason = "NOT_LEADER"


class StaleTermError(NotLeaderError):
    """A fenced transaction found another term (or none) on the election key: etcd applied nothing."""

    def __init__(self, term: int, current: Leader | None) -> None:
        self.term, self.current = term, current
        now = (f"term {current.term} ({current.identity} at {current.address}) is current" if current
               else "no leader holds the key")
        super().__init__(f"NOT_LEADER: fenced write of term {term} refused by etcd: {now}")


async def read_leader(client: aetcd.Client, key: bytes) -> Leader | None:
    got = await client.get(key)
    return None if got is None else Leader.from_kv(got.value, got.create_revision)


async def txn_in_term(client: aetcd.Client, key: bytes, term: int, compare: Sequence = (), success: Sequence = (),
                      failure: Sequence = ()) -> tuple[bool, list]:
    """Run the transaction (compare, success, failure) only if `term` is still the election key's create revision.
    Returns (succeeded, responses) of the inner transaction, as etcd's raw ResponseOps; raises StaleTermError,
    with nothing applied, when the term is not current."""
    tx = client.transactions
    ok, responses = await client.transaction(
        compare=[tx.create(key) == term],
        success=[tx.txn(list(compare), list(success), list(failure))],
        failure=[tx.get(key)])
    if not ok:
        got = responses[0]
        raise StaleTermError(term, Leader.from_kv(got[0][0], got[0][1].create_revision) if got else None)
    inner = responses[0].response_txn
    return inner.succeeded, list(inner.responses)


class Election:
    """One replica's candidacy. `start()` campaigns in the background; `authorised()` / `check()` answer whether it
    may authorise now; `fenced_txn()` writes durable state under its term; `stop()` resigns."""

    def __init__(self, client: aetcd.Client, key: bytes, identity: str, address: str, ttl: int = 10,
                 margin: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl < 1:
            raise ValueError(f"ttl must be a whole number of seconds >= 1 (etcd leases), got {ttl}")
        if not 0 < margin < ttl:
            raise ValueError(f"margin must be in (0, ttl={ttl}), got {margin}")
        self.client, self.key, self.identity, self.address = client, key, identity, address
        self.ttl, self.margin, self._clock = ttl, margin, clock
        self._value = json.dumps({"identity": identity, "address": address}).encode()
        self._lease: aetcd.Lease | None = None
        self._term: int | None = None  # ours, while we believe we lead
        self._last_term = 0
        self._term_since = float("-inf")
        self._ended_at = float("-inf")
        self._authority_until = float("-inf")
        self._last_renewal_sent = float("-inf")
        self._bound = float(ttl) - margin  # replaced by etcd's granted ttl - margin
        self._leader: Leader | None = None
        self._terms_won = 0
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Event()  # set on every change of leader or term, for waiters

    # --- what callers ask -------------------------------------------------------------------------------------

    @property
    def held_term(self) -> int | None:
        """The term this replica holds the key for, its authority current or lapsed (a lapse with the key still its
        own may resume: nobody else can have led meanwhile); None once the term is over."""
        return self._term

    def authorised(self) -> bool:
        return self._term is not None and self._clock() < self._authority_until

    def check(self) -> int:
        """The term under which this replica may authorise now; NotLeaderError otherwise."""
        now = self._clock()
        if self._term is not None and now < self._authority_until:
            return self._term
        if self._last_term:
            end = min(self._ended_at, self._authority_until)
            sent = now - self._last_renewal_sent
            ended = (f"term {self._last_term} ended {now - end:.2f} s ago (authority bound "
                     f"{self._bound:.1f} s since the last renewal etcd answered, sent {sent:.2f} s ago)")
        else:
            ended = f"{self.identity} has not led"
        known = self._leader
        leader = (f"the leader is {known.identity} at {known.address}, term {known.term}"
                  if known and known.term != self._last_term else "no other leader known")
        raise NotLeaderError(f"NOT_LEADER: {ended}; {leader}")

    def state(self) -> ElectionState:
        now = self._clock()
        leading = self._term is not None and now < self._authority_until
        return ElectionState(leading, self._term if leading else (self._leader.term if self._leader else 0),
                             self._leader, max(0.0, self._authority_until - now) if leading else 0.0,
                             self._terms_won, self._term_since, self._authority_until)

    async def fenced_txn(self, compare: Sequence = (), success: Sequence = (),
                         failure: Sequence = ()) -> tuple[bool, list]:
        """`txn_in_term` under this replica's term, refused here first when its authority has ended."""
        return await txn_in_term(self.client, self.key, self.check(), compare, success, failure)

    async def wait_changed(self) -> None:
        """Returns at the next change of leader or term seen by this replica."""
        await self._changed.wait()

    # --- life cycle ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"election {self.identity}")

    async def stop(self, timeout: float = 2.0) -> None:
        """Resign: authorise nothing from here on, delete our key if it still has our term, revoke the lease."""
        term = self._term
        self._lose("resigned")
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:  # the campaign died of a bug: it authorised nothing since; resign all the same
                log.exception("election %s: the campaign task failed", self.identity)
            self._task = None
        if term is not None:
            tx = self.client.transactions
            with contextlib.suppress(*RETRYABLE):
                await asyncio.wait_for(self.client.transaction(
                    compare=[tx.create(self.key) == term], success=[tx.delete(self.key)], failure=[]), timeout)
        await self._revoke(timeout)

    # --- the campaign ------------------------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            try:
                follow_from = await self._campaign()
                if follow_from is None:
                    await self._lead()
                else:
                    await self._follow(follow_from)
                backoff = 0.05
            except RETRYABLE as e:
                log.warning("election %s: etcd: %r; again in %.2f s", self.identity, e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.ttl / 3)

    async def _campaign(self) -> int | None:
        """None when we won; else the revision to watch the current leader's key from."""
        await self._revoke(self.ttl / 3)
        sent = self._clock()
        lease = await self.client.lease(self.ttl)
        self._lease = lease
        tx = self.client.transactions
        txn_sent = self._clock()
        ok, responses = await self.client.transaction(
            compare=[tx.create(self.key) == 0],
            success=[tx.put(self.key, self._value, lease.id), tx.get(self.key)],
            failure=[tx.get(self.key)])
        got = responses[-1][0][1]
        if not ok:
            self._observe(Leader.from_kv(got.value, got.create_revision))
            await self._revoke(self.ttl / 3)
            return got.header.revision + 1
        # a grant starts the lease's ttl at etcd as a renewal does: it counts as the first renewal sent
        self._term = self._last_term = got.create_revision
        self._terms_won += 1
        self._term_since, self._ended_at = txn_sent, float("inf")
        self._renewed(sent, lease.ttl)
        self._observe(Leader(self.identity, self.address, got.create_revision))
        log.info("election %s: leads, term %d (lease %x, ttl %d s)", self.identity, self._term, lease.id, lease.ttl)
        return None

    async def _follow(self, from_revision: int) -> None:
        """Returns once the key is gone (a campaign may win). A watch on a member cut off from its quorum hears
        nothing, so after `ttl` without an event the key is read again (a linearizable Get, which needs quorum)."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.ttl):
                    watch = await self.client.watch(self.key, start_revision=from_revision)
                    try:
                        async for event in watch:
                            if event.kind == EventKind.DELETE:
                                return
                            self._observe(Leader.from_kv(event.kv.value, event.kv.create_revision))
                    finally:
                        with contextlib.suppress(*RETRYABLE):
                            await watch.cancel()
            got = await self.client.get(self.key)
            if got is None:
                return
            self._observe(Leader.from_kv(got.value, got.create_revision))
            from_revision = got.header.revision + 1

    async def _lead(self) -> None:
        renew = asyncio.create_task(self._keep_alive())
        watch = asyncio.create_task(self._watch_own_key())
        why = "the election task stopped"
        try:
            done, _ = await asyncio.wait((renew, watch), return_when=asyncio.FIRST_COMPLETED)
            why = done.pop().result()
        finally:
            for t in (renew, watch):
                t.cancel()
            await asyncio.gather(renew, watch, return_exceptions=True)
            self._lose(why)

    async def _keep_alive(self) -> str:
        """Renews every ttl/3 of the last send; returns why the term ended. A failed renewal is retried sooner;
        the authority bound decays on its own meanwhile."""
        period = self.ttl / 3
        while True:
            await asyncio.sleep(max(0.0, self._last_renewal_sent + period - self._clock()))
            sent = self._clock()
            try:
                reply = await asyncio.wait_for(self._lease.refresh(), period)
            except RETRYABLE as e:
                log.warning("election %s: lease renewal of term %s failed: %r", self.identity, self._term, e)
                await asyncio.sleep(period / 4)
                continue
            if reply is None or reply.TTL <= 0:
                return f"etcd lease {self._lease.id:x} expired"
            if self._clock() >= self._authority_until:
                # our authority lapsed though etcd kept the lease: re-read the key before authorising again
                try:
                    got = await self.client.get(self.key)
                except RETRYABLE as e:
                    log.warning("election %s: reading the key after a lapse: %r", self.identity, e)
                    await asyncio.sleep(period / 4)
                    continue
                if got is None or got.create_revision != self._term:
                    return "the election key changed while our authority had lapsed"
            self._renewed(sent, reply.TTL)

    async def _watch_own_key(self) -> str:
        backoff = 0.05
        while True:
            try:
                watch = await self.client.watch(self.key, start_revision=self._term + 1)
                try:
                    async for event in watch:
                        if event.kind == EventKind.DELETE:
                            return "the election key was deleted"
                        if event.kv.create_revision != self._term:
                            return f"the election key was re-created at revision {event.kv.create_revision}"
                finally:
                    with contextlib.suppress(*RETRYABLE):
                        await watch.cancel()
            except RETRYABLE as e:
                log.warning("election %s: watch of own key: %r; again in %.2f s", self.identity, e, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.ttl / 3)

    # --- transitions (no await in any) ----------------------------------------------------------------------------

    def _renewed(self, sent: float, granted_ttl: int) -> None:
        self._bound = granted_ttl - self.margin
        self._last_renewal_sent = max(self._last_renewal_sent, sent)
        self._authority_until = max(self._authority_until, sent + self._bound)

    def _lose(self, why: str) -> None:
        if self._term is not None:
            self._ended_at = self._clock()
            log.warning("election %s: term %d over: %s", self.identity, self._term, why)
            self._term = None
            self._changed.set()
            self._changed = asyncio.Event()

    def _observe(self, leader: Leader) -> None:
        if leader != self._leader:
            self._leader = leader
            self._changed.set()
            self._changed = asyncio.Event()

    async def _revoke(self, timeout: float) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            with contextlib.suppress(*RETRYABLE):
                await asyncio.wait_for(lease.revoke(), timeout)
