"""The durable free set (docs/design.md §3, "Leader failover"): the only lease state an elected broker keeps in etcd.
Per pool, the pages the leader holds FREE and will not grant until it has taken them out of the set again. A new
leader that adopts the pool frees those at once; every other page it was not handed waits for the earlier term's
writes to drain.

The invariant, stated once: **a page in etcd's set is FREE at the leader and not grantable** (PoolPages.parked).
A page leaves the grantable heap before a write puts it in the set (park), and joins the heap only after a write
that leaves it out has succeeded (reserve). Each write replaces the pool's whole set, the writes of one pool are
serialised, and each is a transaction fenced on the leader's term (a replica whose term ended writes nothing). A
write whose outcome is unknown leaves its pages parked: not granted, whichever way it went.

What a new leader frees at once is what the set holds at the failover, so a floor of it (a sixteenth of the
pool, at most half the low-water mark) is never reserved for grants: a pool that fills with cached pages, or
with leases, would otherwise draw the set empty, and after a failover no request would be admitted until the
unclaimed pages drained. The floor costs that much of the pool's capacity; it is parked once (evicting unread
cached pages if it must) and stays. Over the floor, parked pages are the pool's surplus, reserved first when
grants run short.

Cost: the grant path waits for etcd only when the grantable pages run short of a request (`ensure`), one write
that reserves a whole chunk; the rest happens in the background after grants and releases (`poke`)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from prometheus_client import Counter

from .election import RETRYABLE, Election, NotLeaderError
from .lease_table import LeaseError, LeaseTable

log = logging.getLogger(__name__)
WRITES = Counter("pdserve_broker_free_set_writes_total", "Writes of durable free sets to etcd (one round trip each), "
                 "by what they did", ["op"])
for _op in ("reserve", "park", "failed"):
    WRITES.labels(_op)
_DELETES_PER_TXN = 100  # etcd refuses a transaction of more than --max-txn-ops (128 by default)


def encode(pages, num_pages: int) -> bytes:
    bits = bytearray((num_pages + 7) // 8)
    for page_id in pages:
        bits[page_id >> 3] |= 1 << (page_id & 7)
    return bytes(bits)


def decode(value: bytes, num_pages: int) -> set[int]:
    """The pages of a stored set; refuses one that does not fit the pool (ValueError)."""
    if len(value) != (num_pages + 7) // 8:
        raise ValueError(f"a free set of {len(value)} bytes does not fit a pool of {num_pages} pages")
    pages = {i * 8 + b for i, byte in enumerate(value) if byte for b in range(8) if byte >> b & 1}
    if pages and max(pages) >= num_pages:
        raise ValueError(f"the free set names page {max(pages)} of a pool of {num_pages} pages")
    return pages


class DurableFreeSet:
    """low: the grantable pages the leader keeps per pool at least (min_pages, or that fraction of the pool, at
    most a quarter of it); under it, it reserves up to twice it from the surplus; over four times it, it parks
    down to twice it: a wide band, so steady load writes etcd seldom. The floor (a sixteenth of the pool, at most
    half of low) is parked for good."""

    def __init__(self, election: Election, cluster: str, table: LeaseTable, fraction: float = 1 / 8,
                 min_pages: int = 64) -> None:
        self.election, self.cluster, self.table = election, cluster, table
        self.fraction, self.min_pages = fraction, min_pages
        self._locks: dict[str, asyncio.Lock] = {}
        self._balancing: dict[str, asyncio.Task] = {}

    def key(self, pool_id: str) -> bytes:
        return self._prefix() + f"{pool_id}/free".encode()

    def _prefix(self) -> bytes:
        return f"/pdserve/{self.cluster}/pools/".encode()

    def low(self, num_pages: int) -> int:
        return max(1, min(num_pages // 4, max(self.min_pages, int(num_pages * self.fraction))))

    def floor(self, num_pages: int) -> int:
        return max(1, min(self.low(num_pages) // 2, num_pages // 16))

    async def load(self, pool_id: str, num_pages: int) -> set[int]:
        """The set an earlier leader left for the pool (empty when none), read at adoption."""
        got = await self.election.client.get(self.key(pool_id))
        return set() if got is None else decode(got.value, num_pages)

    async def ensure(self, pool_id: str, need: int) -> None:
        """Before a Grant or Extend of `need` pages: reserve enough of them now if the grantable ones are short.
        Best effort: a failure leaves the pages parked, and the call is refused for want of pages if it must be."""
        try:
            short = need - self.table.num_grantable(pool_id)
            parked = self.table.num_parked(pool_id)  # a count: a Grant copies no set of the pool
            if short <= 0 or not parked:
                return
            num_pages = self.table.pool_state(pool_id)["num_pages"]
            take = min(parked - self.floor(num_pages), short + self.low(num_pages))  # a chunk at a time
            if take > 0:
                await self._reserve(pool_id, take)
        except LeaseError:
            pass  # an unknown pool: the call itself says so

    def poke(self, pool_id: str) -> None:
        """After the pool's grantable pages changed: rebalance in the background."""
        task = self._balancing.get(pool_id)
        if task is None or task.done():
            self._balancing[pool_id] = asyncio.get_running_loop().create_task(self._balance(pool_id))

    async def forget(self, pool_id: str) -> None:
        """The pool is gone: its set goes too (best effort; a write of another term is refused in etcd)."""
        tx = self.election.client.transactions
        try:
            await self.election.fenced_txn(success=[tx.delete(self.key(pool_id))])
        except (NotLeaderError, *RETRYABLE) as e:
            log.warning("pool %s: deleting its durable free set failed: %r", pool_id, e)
        self._locks.pop(pool_id, None)
        self._balancing.pop(pool_id, None)

    async def forget_orphans(self, known: Callable[[], Iterable[str]]) -> int:
        """Deletes the sets of pools this leader does not know (`known()`): pools whose decode registered anew, or
        stopped, under an earlier leader that could not delete them. Called once a term has led for longer than
        any decode waits to hand its pool over; a set deleted too early would only make a later hand-over
        quarantine what it names (fail safe). Returns how many went."""
        got = await self.election.client.get_prefix(self._prefix(), keys_only=True)
        keep = {self.key(pool_id) for pool_id in known()}
        stale = [kv.key for kv in got if kv.key not in keep]
        tx = self.election.client.transactions
        for i in range(0, len(stale), _DELETES_PER_TXN):
            await self.election.fenced_txn(success=[tx.delete(key) for key in stale[i:i + _DELETES_PER_TXN]])
        if stale:
            log.info("deleted the durable free sets of %d pools no decode handed over: %s", len(stale),
                     [key.decode() for key in stale[:4]])
        return len(stale)

    async def _balance(self, pool_id: str) -> None:
        try:
            num_pages = self.table.pool_state(pool_id)["num_pages"]
            low, grantable = self.low(num_pages), self.table.num_grantable(pool_id)
            parked, floor = self.table.num_parked(pool_id), self.floor(num_pages)
            if grantable < low and parked > floor:
                await self._reserve(pool_id, min(2 * low - grantable, parked - floor))
            elif grantable > 4 * low:
                await self._park(pool_id, grantable - 2 * low)
            elif parked < floor:  # the floor, from what the pool can spare
                spare = max(0, grantable - low)
                num = min(floor - parked, spare + self.table.num_unread_cached(pool_id))
                if num > 0:
                    await self._park(pool_id, num, evict=max(0, num - spare))
        except LeaseError:
            pass  # forgotten meanwhile

    async def _reserve(self, pool_id: str, num: int) -> None:
        async with self._lock(pool_id):
            parked = self.table.parked(pool_id)
            taken = sorted(parked)[:num]  # the lowest: grants come out contiguous
            if taken and await self._write(pool_id, parked - set(taken), "reserve"):
                self.table.unpark(pool_id, taken)

    async def _park(self, pool_id: str, num: int, evict: int = 0) -> None:
        async with self._lock(pool_id):
            self.table.evict_for_parking(pool_id, evict)
            self.table.park(pool_id, num)  # out of the heap first: never granted from here on
            await self._write(pool_id, self.table.parked(pool_id), "park")

    async def _write(self, pool_id: str, pages, op: str) -> bool:
        """Replaces the pool's set; whether it is known to have been applied."""
        tx = self.election.client.transactions
        num_pages = self.table.pool_state(pool_id)["num_pages"]
        try:
            await self.election.fenced_txn(success=[tx.put(self.key(pool_id), encode(pages, num_pages))])
        except (NotLeaderError, *RETRYABLE) as e:
            log.warning("pool %s: writing its durable free set (%d pages) failed: %r; those pages stay parked",
                        pool_id, len(pages), e)
            WRITES.labels("failed").inc()
            return False
        WRITES.labels(op).inc()
        return True

    def _lock(self, pool_id: str) -> asyncio.Lock:
        return self._locks.setdefault(pool_id, asyncio.Lock())
