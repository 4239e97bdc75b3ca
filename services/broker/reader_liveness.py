"""The reader fence: leases tied to their reader's liveness (docs/design.md §3, "Liveness" and "Broker
replacement"). A decode renews its pool's reader record with the complete list of owners it holds; the owners it
no longer holds (a Grant whose reply was lost, a Release that failed), and every owner of a pool whose decode
stopped renewing, are revoked, through quarantine: the holder may still be mid-step.

ReaderFence owns each pool's reader record (`reader_expiry`), the revoked owners waiting for their reader's
acknowledgement (`unacked`) and the ids of forgotten pools. It decides (which owners are stale, which revocations
are acknowledged, which pools may be forgotten, whether a pool is fenced); LeaseTable revokes and forgets.

A pool whose reader expired is fenced for good: its decode may have moved to another broker incarnation, which must
be able to count on this one accepting no Grant, BeginWrite or renewal of a writer on the pool from then on. Once
nothing of it is leased or quarantined, the pool is forgotten (its pages, its revocation log, its metric series),
so memory stays bounded across decode restarts; its decode then registers a new incarnation (formal/pdserve.pml:
oldfenced, FENCE_WAITED)."""
from __future__ import annotations

from collections import deque
from typing import Callable, Iterable

from .liveness import Liveness
from .pages import LeaseError, PoolPages

NOT_HELD, READER_EXPIRED = "NOT_HELD", "READER_EXPIRED"
FORGOTTEN_MEMORY = 1024  # ids of forgotten pools remembered, so a late call gets a clear answer (bounded)


class ReaderFence:
    def __init__(self, liveness: Liveness, clock: Callable[[], float], reader_ttl_s: float, reconcile_grace_s: float,
                 max_ttl_s: float, lock_delay_s: float):
        if reader_ttl_s <= 0 or reconcile_grace_s < 0:
            raise ValueError(f"need reader_ttl_s {reader_ttl_s} > 0 and reconcile_grace_s {reconcile_grace_s} >= 0")
        self._liveness = liveness
        self._clock = clock
        self.reader_ttl_s, self.reconcile_grace_s = reader_ttl_s, reconcile_grace_s
        self._max_ttl_s, self._lock_delay_s = max_ttl_s, lock_delay_s
        self._forgotten: deque[str] = deque(maxlen=FORGOTTEN_MEMORY)

    @property
    def fence_s(self) -> float:
        """After a decode's last contact, how long a write this broker accepted may still land in its pool: the
        reader expires (no BeginWrite or writer renewal from then on), the last writer renewed before that
        lapses (at most max_ttl), and what it posted lands within lock_delay."""
        return self.reader_ttl_s + self._max_ttl_s + self._lock_delay_s

    @staticmethod
    def is_fenced(pool: PoolPages, now: float) -> bool:
        return pool.reader_expiry <= now

    def check(self, pool: PoolPages) -> None:
        """Refuses work on a fenced pool (its decode stopped renewing it: it may serve from another broker)."""
        now = self._clock()
        if pool.reader_expiry <= now:
            raise LeaseError("UNAVAILABLE", "POOL_FENCED",
                             f"pool {pool.pool_id}: its decode last renewed it "
                             f"{now - pool.reader_expiry + self.reader_ttl_s:.2f}s ago (reader ttl "
                             f"{self.reader_ttl_s:g}s); this broker accepts no more work on it")

    def check_writer(self, pools: Iterable[PoolPages], holder_id: str) -> None:
        """A writer active on a fenced pool gets no more liveness: it must stop posting within its ttl."""
        now = self._clock()
        for pool in pools:
            if pool.reader_expiry > now:
                continue
            for page_id in pool.writing:
                writer = pool.pages[page_id].active_writer
                if writer is not None and writer[0] == holder_id:
                    raise LeaseError("FAILED_PRECONDITION", "POOL_FENCED",
                                     f"writer {holder_id} writes to pool {pool.pool_id}, whose decode stopped renewing "
                                     "it; its liveness is not renewed")

    def check_not_forgotten(self, pool_id: str) -> None:
        if pool_id in self._forgotten:
            raise LeaseError("NOT_FOUND", "POOL_FORGOTTEN",
                             f"pool {pool_id} was fenced (its decode stopped renewing it) and forgotten; register a "
                             "new incarnation")

    def renew(self, pool: PoolPages) -> None:
        pool.reader_expiry = self._clock() + self.reader_ttl_s

    def keep_alive(self, pool: PoolPages, held: set[bytes]) -> list[bytes]:
        """Renews the reader of a pool not fenced yet; returns the owners to revoke: those it does not hold, past the
        grace (>= decode's RPC timeout) that spares an owner whose Grant reply is still on its way: a KeepAlive built
        before decode knew of the owner cannot arrive later than one RPC timeout."""
        if pool.reader_expiry <= self._clock():
            raise LeaseError("NOT_FOUND", "POOL_EXPIRED",
                             f"pool {pool.pool_id} was not renewed within its reader ttl {self.reader_ttl_s:g}s and is "
                             "fenced here; register a new incarnation")
        self.renew(pool)
        now = self._clock()
        return [owner for owner in pool.owners
                if owner not in held and now - pool.granted_at.get(owner, now) > self.reconcile_grace_s]

    def revoked(self, pool: PoolPages, owner: bytes, holder: str, seq: int) -> None:
        """owner's pages were revoked (revocation seq) under holder, which stands in for any step of owner's still
        running: held until the reader acknowledges, at once when the pool is fenced (nothing is ever granted
        from it again)."""
        self._liveness.hold(holder)
        pool.unacked[owner] = (holder, seq)
        if pool.reader_expiry <= self._clock():
            self.acknowledge(pool, owner, pool.reader_expiry)

    def acknowledge_absent(self, pool: PoolPages, held: set[bytes], revocations_seen: int) -> None:
        """decode lists every owner a step may still write (the step in flight too). It had processed the owner's
        revocation when it built this list (seq <= revocations_seen), so it knew of the owner: its absence is no
        stale view from before the Grant, and no step of it can run any more."""
        for owner, (_, seq) in list(pool.unacked.items()):
            if owner not in held and seq <= revocations_seen:
                self.acknowledge(pool, owner)

    def acknowledge(self, pool: PoolPages, owner: bytes, at: float | None = None) -> None:
        """No step of the revoked owner can write its pages any more (or, at: the pool is fenced from then on, so
        nothing is ever granted from it again): from then only lock_delay holds them."""
        holder, _ = pool.unacked.pop(owner)
        self._liveness.end(holder, at)

    def forgettable(self, pools: Iterable[PoolPages]) -> list[str]:
        """The pools fenced at least lock_delay ago with no page leased, quarantined or under a writer any more."""
        now = self._clock()
        return [pool.pool_id for pool in pools
                if pool.reader_expiry + self._lock_delay_s <= now and not pool.owners and not pool.quarantined
                and not pool.writing]

    def forgotten(self, pool_id: str) -> None:
        """The pool was dropped: a late call about it is told so (POOL_FORGOTTEN)."""
        self._forgotten.append(pool_id)
