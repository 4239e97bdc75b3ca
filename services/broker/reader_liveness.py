"""Leases tied to their reader's liveness (a mixin of LeaseTable). A decode renews its pool's reader record
with the complete list of owners it holds; the broker revokes the pool's owners it no longer holds (a Grant
whose reply was lost, a Release that failed), and all leases of a pool whose decode stopped renewing.
Every such end is a revocation, so it goes through quarantine: the holder may still be mid-step.

A pool whose reader expired is fenced for good: its decode may have moved to another broker incarnation
(a rolling update, a partition), which must be able to count on this one accepting no Grant, BeginWrite or
renewal of a writer on the pool from then on. Once nothing of it is leased or quarantined, the pool is
forgotten (its pages, its revocation log, its metric series), so memory stays bounded across decode
restarts; its decode then registers a new incarnation (formal/pdserve.pml: oldfenced, FENCE_WAITED)."""
from __future__ import annotations

from collections import deque
from typing import Callable, Iterable

from .pages import LeaseError, PoolPages

NOT_HELD, READER_EXPIRED = "NOT_HELD", "READER_EXPIRED"
FORGOTTEN_MEMORY = 1024  # ids of forgotten pools remembered, so a late call gets a clear answer (bounded)


class ReaderLiveness:
    # set by LeaseTable.__init__; _pool and revoke are LeaseTable's
    reader_ttl_s: float
    reconcile_grace_s: float
    _clock: Callable[[], float]
    _pools: dict[str, PoolPages]
    lock_delay_s: float
    max_ttl_s: float
    _liveness: dict[str, float]

    def _check_reader_bounds(self) -> None:
        if self.reader_ttl_s <= 0 or self.reconcile_grace_s < 0:
            raise ValueError(f"need reader_ttl_s {self.reader_ttl_s} > 0 and reconcile_grace_s "
                             f"{self.reconcile_grace_s} >= 0")
        self._forgotten: deque[str] = deque(maxlen=FORGOTTEN_MEMORY)

    @property
    def fence_s(self) -> float:
        """After a decode's last contact, how long a write this broker accepted may still land in its pool: the
        reader expires (no BeginWrite or writer renewal from then on), the last writer renewed before that
        lapses (at most max_ttl), and what it posted lands within lock_delay."""
        return self.reader_ttl_s + self.max_ttl_s + self.lock_delay_s

    def check_reader(self, pool: PoolPages) -> None:
        """Refuses work on a fenced pool (its decode stopped renewing it: it may serve from another broker)."""
        now = self._clock()
        if pool.reader_expiry <= now:
            raise LeaseError("UNAVAILABLE", "POOL_FENCED",
                             f"pool {pool.pool_id}: its decode last renewed it "
                             f"{now - pool.reader_expiry + self.reader_ttl_s:.2f}s ago (reader ttl "
                             f"{self.reader_ttl_s:g}s); this broker accepts no more work on it")

    def check_writer_renewal(self, holder_id: str) -> None:
        """A writer active on a fenced pool gets no more liveness: it must stop posting within its ttl."""
        now = self._clock()
        for pool in self._pools.values():
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

    def renew_reader(self, pool: PoolPages) -> None:
        pool.reader_expiry = self._clock() + self.reader_ttl_s

    def reader_keep_alive(self, pool_id: str, held_owners: Iterable[bytes], revocations_seen: int = 0) -> list[bytes]:
        """Renews the pool's reader and revokes the owners it does not hold; returns those owners.
        The grace (>= decode's RPC timeout) spares an owner whose Grant reply is still on its way: a
        KeepAlive built before decode knew of the owner cannot arrive later than one RPC timeout.
        revocations_seen: the seq of the last revocation decode had processed when it listed held_owners; a
        revoked owner up to it that decode no longer holds is acknowledged (no step of it can still run)."""
        self.check_not_forgotten(pool_id)
        pool = self._pool(pool_id)
        if pool.reader_expiry <= self._clock():
            raise LeaseError("NOT_FOUND", "POOL_EXPIRED",
                             f"pool {pool_id} was not renewed within its reader ttl {self.reader_ttl_s:g}s and is "
                             "fenced here; register a new incarnation")
        self.renew_reader(pool)
        now = self._clock()
        held = set(held_owners)
        stale = [owner for owner in pool.owners
                 if owner not in held and now - pool.granted_at.get(owner, now) > self.reconcile_grace_s]
        for owner in stale:
            pool.note_released(owner)  # decode's own word that it let go: a Release that was lost
            self.revoke(pool_id, owner, NOT_HELD)
        # decode lists every owner a step may still write (the step in flight too). It had processed the owner's
        # revocation when it built this list (seq <= revocations_seen), so it knew of the owner: its absence is
        # no stale view from before the Grant, and no step of it can run any more
        for owner, (_, seq) in list(pool.unacked.items()):
            if owner not in held and seq <= revocations_seen:
                self.acknowledge(pool, owner)
        return stale

    def acknowledge(self, pool: PoolPages, owner: bytes, at: float | None = None) -> None:
        """No step of the revoked owner can write its pages any more (or, at: the pool is fenced from then on, so
        nothing is ever granted from it again): from then only lock_delay holds them."""
        holder, _ = pool.unacked.pop(owner)
        self._liveness[holder] = self._clock() if at is None else at

    def expire_readers(self) -> int:
        """Revokes every lease of each pool whose reader's record has expired; returns the owners revoked."""
        now = self._clock()
        num_revoked = 0
        for pool in self._pools.values():
            if pool.reader_expiry > now:
                continue
            for owner in list(pool.owners):
                self.revoke(pool.pool_id, owner, READER_EXPIRED)
                num_revoked += 1
            for owner in list(pool.unacked):  # a fenced pool is never granted from again
                self.acknowledge(pool, owner, min(now, pool.reader_expiry))
        return num_revoked

    def forget_pools(self) -> list[str]:
        """Forgets each pool fenced at least lock_delay ago that has no page leased, quarantined or under a
        writer any more; returns their ids."""
        now = self._clock()
        gone = [pool.pool_id for pool in self._pools.values()
                if pool.reader_expiry + self.lock_delay_s <= now and not pool.owners and not pool.quarantined
                and not pool.writing]
        for pool_id in gone:
            del self._pools[pool_id]
            self._forgotten.append(pool_id)
        return gone

    def last_seq(self, pool_id: str) -> int:
        return self._pool(pool_id).revocations.last_seq

    def revocations_since(self, pool_id: str, after_seq: int):
        """(revocations with seq > after_seq, whether the log lost some of them, the pool's last seq)."""
        log = self._pool(pool_id).revocations
        events, gap = log.since(after_seq)
        return events, gap, log.last_seq
