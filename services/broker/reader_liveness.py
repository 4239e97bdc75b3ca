"""Leases tied to their reader's liveness (a mixin of LeaseTable). A decode renews its pool's reader record
with the complete list of owners it holds; the broker revokes the pool's owners it no longer holds (a Grant
whose reply was lost, a Release that failed), and all leases of a pool whose decode stopped renewing.
Every such end is a revocation, so it goes through quarantine: the holder may still be mid-step."""
from __future__ import annotations

from typing import Callable, Iterable

from .pages import PoolPages

NOT_HELD, READER_EXPIRED = "NOT_HELD", "READER_EXPIRED"


class ReaderLiveness:
    # set by LeaseTable.__init__; _pool and revoke are LeaseTable's
    reader_ttl_s: float
    reconcile_grace_s: float
    _clock: Callable[[], float]
    _pools: dict[str, PoolPages]

    def _check_reader_bounds(self) -> None:
        if self.reader_ttl_s <= 0 or self.reconcile_grace_s < 0:
            raise ValueError(f"need reader_ttl_s {self.reader_ttl_s} > 0 and reconcile_grace_s "
                             f"{self.reconcile_grace_s} >= 0")

    def renew_reader(self, pool: PoolPages) -> None:
        pool.reader_expiry = self._clock() + self.reader_ttl_s

    def reader_keep_alive(self, pool_id: str, held_owners: Iterable[bytes]) -> list[bytes]:
        """Renews the pool's reader and revokes the owners it does not hold; returns those owners.
        The grace (>= decode's RPC timeout) spares an owner whose Grant reply is still on its way: a
        KeepAlive built before decode knew of the owner cannot arrive later than one RPC timeout."""
        pool = self._pool(pool_id)
        self.renew_reader(pool)
        now = self._clock()
        held = set(held_owners)
        stale = [owner for owner in pool.owners
                 if owner not in held and now - pool.granted_at.get(owner, now) > self.reconcile_grace_s]
        for owner in stale:
            self.revoke(pool_id, owner, NOT_HELD)
        return stale

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
        return num_revoked

    def revocations_since(self, pool_id: str, after_seq: int):
        """(revocations with seq > after_seq, whether the log lost some of them, the pool's last seq)."""
        log = self._pool(pool_id).revocations
        events, gap = log.since(after_seq)
        return events, gap, log.last_seq
