"""The broker's lease table (docs/design.md §3): which owner may use which page of a decode pool, at which
generation. Plain Python, no torch and no gRPC, so the protocol is testable on its own. Every public method is one
atomic step of the formal model; the servicer only translates messages and errors.

LeaseTable owns the pools of one broker incarnation (its epoch) and orders each step; it is composed of parts that
each own one table: every pool's pages (PoolPages, pages.py: every page transition), holders' liveness (Liveness,
liveness.py), the reader fence (ReaderFence, reader_liveness.py) and prefix shares (PrefixShares,
prefix_leases.py). Each part is handed what it needs; none calls back into this one."""

import secrets
import time
from collections import Counter
from dataclasses import replace
from typing import Callable, Iterable, Sequence

from .liveness import Liveness
from .pages import (OWNER_NBYTES, Lease, LeaseError, Page, PageState, PoolPages, Revocation, check_owner,
                    check_prefix_args)
from .prefix_leases import PrefixShares
from .reader_liveness import NOT_HELD, READER_EXPIRED, ReaderFence

__all__ = ["OWNER_NBYTES", "Lease", "LeaseError", "LeaseTable", "Page", "PageState", "Revocation"]


class LeaseTable:
    """All pools of one broker incarnation; a new table is a new epoch, and nothing of an old one validates."""

    def __init__(self, lock_delay_s: float = 2.0, default_writer_ttl_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, epoch: int | None = None, max_ttl_s: float = 60.0,
                 reader_ttl_s: float = 5.0, reconcile_grace_s: float = 15.0):
        if lock_delay_s < 0 or not 0 < default_writer_ttl_s <= max_ttl_s or (epoch is not None and not 0 < epoch < 2**64):
            raise ValueError(f"need lock_delay_s {lock_delay_s} >= 0, 0 < default_writer_ttl_s "
                             f"{default_writer_ttl_s} <= max_ttl_s {max_ttl_s} and epoch {epoch} in [1, 2**64)")
        self.lock_delay_s = lock_delay_s
        self.default_writer_ttl_s = default_writer_ttl_s
        self.max_ttl_s = max_ttl_s
        # never 0: a zero epoch would match a request that forgot to set the field
        self.epoch = (secrets.randbits(64) or 1) if epoch is None else epoch
        self._clock = clock
        self._pools: dict[str, PoolPages] = {}
        self._liveness = Liveness(clock, default_writer_ttl_s, lock_delay_s)
        self._fence = ReaderFence(self._liveness, clock, reader_ttl_s, reconcile_grace_s, max_ttl_s, lock_delay_s)
        self._shares = PrefixShares(self._liveness)
        self.term = 0
        self._generations = (1, 2**63)  # [first, limit) of the generations this table grants

    def take_identity(self, epoch: int, term: int) -> None:
        """A replica that won `term` answers under the cluster's one epoch, and grants generations from term << 32
        up, above every earlier term's (docs/design.md §3, "Leader failover"). Only before any pool is known."""
        if self._pools:
            raise RuntimeError(f"the lease identity is taken before any pool is registered; {len(self._pools)} are")
        if not 0 < epoch < 2**64 or not 0 < term < 2**31:
            raise ValueError(f"epoch {epoch} must be in [1, 2**64) and term {term} in [1, 2**31)")
        self.epoch, self.term = epoch, term
        self._generations = (term << 32, (term + 1) << 32)

    @property
    def reader_ttl_s(self) -> float:
        return self._fence.reader_ttl_s

    @property
    def reconcile_grace_s(self) -> float:
        return self._fence.reconcile_grace_s

    @property
    def fence_s(self) -> float:
        return self._fence.fence_s

    def take_prefix_counts(self) -> Counter[str]:
        """The prefix cache events since the last call (hits, published, evicted_lru, evicted_corrupt,
        cross_scope)."""
        return self._shares.take_counts()

    def register_pool(self, pool_id: str, num_pages: int, quarantined: Iterable[int] = (), region=None) -> int:
        """`quarantined`: pages a decode held under an earlier epoch (the broker restarted). Writes of that
        epoch may still be in flight, so those pages start QUARANTINED and leave only after lock_delay.
        `region`: where the pool's bytes are registered; writers get it from here, never from a request."""
        if not pool_id or num_pages <= 0:
            raise LeaseError("INVALID_ARGUMENT", "BAD_POOL", f"pool {pool_id!r} of {num_pages} pages: "
                             "needs a name and at least 1 page")
        self._fence.check_not_forgotten(pool_id)
        held = sorted(set(quarantined))
        if held and not 0 <= held[0] <= held[-1] < num_pages:
            raise LeaseError("INVALID_ARGUMENT", "PAGE_OUT_OF_RANGE",
                             f"quarantined pages must be in [0, {num_pages}), got {held[0]}..{held[-1]}")
        pool = self._pools.get(pool_id)
        if pool is None:
            pool = self._pools[pool_id] = PoolPages(pool_id, num_pages, region=region,
                                                    next_generation=self._generations[0],
                                                    generation_limit=self._generations[1])
            if held:
                writer = f"earlier-epoch/{pool_id}"
                # an old-epoch writer renews at most one ttl before it learns the epoch changed and stops
                self._liveness.end(writer, self._clock() + self.default_writer_ttl_s)
                pool.hold(held, writer)
        elif pool.num_pages != num_pages:
            raise LeaseError("ALREADY_EXISTS", "POOL_SIZE_MISMATCH",
                             f"pool {pool_id} is registered with {pool.num_pages} pages; {num_pages} given")
        elif self._fence.is_fenced(pool, self._clock()):
            raise LeaseError("NOT_FOUND", "POOL_EXPIRED", f"pool {pool_id} is fenced here (its reader expired); "
                                                          "register a new incarnation")
        elif pool.region != region:
            # a second registration must not move where writers aim: leases already granted point there
            raise LeaseError("ALREADY_EXISTS", "POOL_REGION_MISMATCH",
                             f"pool {pool_id} is registered at another transfer session or address")
        self._fence.renew(pool)
        return self.epoch

    def adopt_pool(self, pool_id: str, num_pages: int, region, epoch: int, term_seen: int, revocations_seen: int,
                   claims: list[tuple[bytes, list[Lease], list[bool]]], parked: Iterable[int] = ()) -> int:
        """A pool a leader of an earlier term knew, handed over by its decode (docs/design.md §3, "Leader
        failover"): what decode claims stays as it was, the pages of the durable free set (`parked`, read from
        etcd) are free (PoolPages.adopt), every other page waits until the earlier term's writes have drained. Those writers' liveness ended by this term's start at the latest (its leader's
        authority had ended, and it renewed no writer beyond max_ttl), so the stand-in holder expires max_ttl after
        now and the pages leave quarantine lock_delay after that. The pool's revocations continue after decode's
        cursor. Refused (FAILED_PRECONDITION) where this leader cannot adopt: decode then registers anew."""
        if not self.term:
            raise LeaseError("FAILED_PRECONDITION", "NOT_ELECTED", f"this broker runs without election: pool "
                                                                   f"{pool_id} is registered anew, not adopted")
        if epoch != self.epoch:
            raise LeaseError("FAILED_PRECONDITION", "EPOCH_MISMATCH", f"the claim's epoch {epoch:#x} is not this "
                                                                      f"cluster's {self.epoch:#x}")
        if not 0 < term_seen < self.term:
            raise LeaseError("FAILED_PRECONDITION", "NOT_AN_EARLIER_TERM",
                             f"pool {pool_id} was last answered under term {term_seen}; this leader's term is "
                             f"{self.term}: only a pool of an earlier term is adopted")
        if not pool_id or num_pages <= 0:
            raise LeaseError("INVALID_ARGUMENT", "BAD_POOL", f"pool {pool_id!r} of {num_pages} pages")
        self._fence.check_not_forgotten(pool_id)
        if pool_id in self._pools:
            raise LeaseError("FAILED_PRECONDITION", "POOL_KNOWN", f"pool {pool_id} is known to this leader already")
        pool = PoolPages(pool_id, num_pages, region=region, next_generation=self._generations[0],
                         generation_limit=self._generations[1])
        holder = f"earlier-term/{pool_id}"
        now = self._clock()
        pool.adopt(claims, holder, now, set(parked))
        self._liveness.end(holder, now + self.max_ttl_s)
        pool.revocations.continue_after(revocations_seen)
        self._pools[pool_id] = pool
        self._fence.renew(pool)
        return self.epoch

    # the durable free set's bookkeeping (free_set.py writes it to etcd between these steps)
    def park(self, pool_id: str, num: int) -> list[int]:
        return self._pool(pool_id).park(num)

    def unpark(self, pool_id: str, page_ids: list[int]) -> None:
        self._pool(pool_id).unpark(page_ids)

    def parked(self, pool_id: str) -> frozenset[int]:
        return frozenset(self._pool(pool_id).parked)

    def num_parked(self, pool_id: str) -> int:
        return len(self._pool(pool_id).parked)

    def num_grantable(self, pool_id: str) -> int:
        return len(self._pool(pool_id).free)

    def evict_for_parking(self, pool_id: str, num: int) -> None:
        """Evicts up to num unread cached pages, least recently read first, into the grantable pages (for the
        durable free set to park next)."""
        pool = self._pool(pool_id)
        num = min(num, pool.cache.num_evictable())
        if num > 0:
            self._shares.make_room(pool, len(pool.free) + num, [], f"{num} pages to park")

    def grant(self, pool_id: str, owner: bytes, num_pages: int, epoch: int) -> list[Lease]:
        """An exclusive grant (no prefix reuse): grant_with_prefix's leases alone."""
        return self.grant_with_prefix(pool_id, owner, num_pages, epoch)[0]

    def grant_with_prefix(self, pool_id: str, owner: bytes, num_pages: int, epoch: int,
                          prefix_chains: Sequence[bytes] = (),
                          scope_tag: bytes = b"") -> tuple[list[Lease], int, list[int]]:
        """All or nothing: (leases, num_shared, their published checksums). The first num_shared leases are cached
        pages of the longest run of prefix_chains from the first that this pool indexes under scope_tag (at most
        num_pages - 1: the page of the last prompt token is always written), leased read-only at the generation
        they were cached at; the rest are fresh pages at one new generation. Unread cached pages are evicted,
        least recently read first, before a grant is refused for want of free pages."""
        check_owner(owner)
        if num_pages <= 0:
            raise LeaseError("INVALID_ARGUMENT", "BAD_NUM_PAGES", f"num_pages {num_pages} must be > 0")
        check_prefix_args(prefix_chains, scope_tag)
        pool = self._pool(pool_id, epoch)
        self._fence.check(pool)
        if owner in pool.owners:
            raise LeaseError("ALREADY_EXISTS", "OWNER_HAS_LEASE",
                             f"owner {owner.hex()} holds {len(pool.owners[owner])} pages of pool {pool_id}")
        shared = self._shares.shared_run(pool, prefix_chains[:num_pages - 1], scope_tag)
        self._shares.make_room(pool, num_pages - len(shared), shared,
                               f"{num_pages} requested ({len(shared)} of them cached)")
        generation = pool.new_generation()
        pool.open_owner(owner, self._clock())
        self._shares.share(pool, owner, shared)
        taken = pool.lease(owner, num_pages - len(shared), generation)
        return ([(page_id, pool.pages[page_id].generation) for page_id in shared]
                + [(page_id, generation) for page_id in taken],
                len(shared), [pool.pages[page_id].checksum for page_id in shared])

    def extend(self, pool_id: str, epoch: int, items: list[tuple[bytes, int]]) -> list[list[Lease] | LeaseError]:
        """Pages on demand: more pages for owners that hold leases here now, one result per item (the new leases,
        or why that item was refused; the others go on). Each item takes a fresh generation, sealed at once: a
        growth page is written by its decode's steps alone, so no BeginWrite may ever name it. The pages join the
        owner's lease list, so Release, Revoke and reconciliation end them with the owner's other pages; an owner
        released or revoked first gets none (an Extend racing a Revoke must not lease pages to a revoked owner)."""
        pool = self._pool(pool_id, epoch)
        self._fence.check(pool)
        results: list[list[Lease] | LeaseError] = []
        for owner, num_pages in items:
            try:
                check_owner(owner)
                if num_pages <= 0:
                    raise LeaseError("INVALID_ARGUMENT", "BAD_NUM_PAGES", f"num_pages {num_pages} must be > 0")
                if not pool.owners.get(owner):
                    raise LeaseError("FAILED_PRECONDITION", "OWNER_NOT_LEASED",
                                     f"owner {owner.hex()} holds no leases in pool {pool_id} "
                                     f"({self._why_ended(pool, owner)}); {num_pages} growth pages refused")
                self._shares.make_room(pool, num_pages, [], f"{num_pages} growth pages requested for {owner.hex()}")
            except LeaseError as e:
                results.append(e)
                continue
            generation = pool.new_generation()
            taken = pool.lease(owner, num_pages, generation, sealed=True)
            results.append([(page_id, generation) for page_id in taken])
        return results

    @staticmethod
    def _why_ended(pool: PoolPages, owner: bytes) -> str:
        """An owner's revocation while its decode has not acknowledged it (with its reason), for a refusal."""
        if owner in pool.unacked and (event := pool.revocations.get(pool.unacked[owner][1])) is not None:
            return f"revoked: {event.reason}"
        return "released or revoked"

    def begin_write(self, pool_id: str, owner: bytes, epoch: int, leases: Iterable[Lease], writer_id: str,
                    max_landing_s: float, writer_ttl_s: float = 0.0):
        """Returns the pool's registered region: the only place the writer may write to. writer_ttl_s > 0 also
        renews the writer's liveness, as a KeepAlive just before it would (one call fewer per write)."""
        if not writer_id:
            raise LeaseError("INVALID_ARGUMENT", "BAD_WRITER_ID", "writer_id must not be empty")
        # the one timing inequality: a page leaves quarantine lock_delay after the writer's liveness expired or
        # it acked a failure, so a write still landing later than that could hit a page granted again
        if not 0 < max_landing_s <= self.lock_delay_s:
            raise LeaseError("FAILED_PRECONDITION", "LANDING_BOUND_EXCEEDS_LOCK_DELAY",
                             f"writer {writer_id}: a posted write may land up to {max_landing_s:.3f}s after it was "
                             f"posted; the broker's lock_delay is {self.lock_delay_s:.3f}s (needs 0 < bound <= "
                             f"lock_delay)")
        leases = list(leases)
        pool = self._pool(pool_id, epoch)
        self._fence.check(pool)
        pages = self._checked(pool, owner, leases)
        for (page_id, generation), page in zip(leases, pages):
            if page.sealed_generation == generation:
                raise LeaseError("FAILED_PRECONDITION", "LEASE_ALREADY_WRITTEN",
                                 f"page {page_id} generation {generation} was already written or validated; a lease "
                                 "generation is written at most once")
        if writer_ttl_s:
            self.keep_alive(writer_id, writer_ttl_s)
        self._liveness.start(writer_id, self._clock())
        # every page of the Grant's generation is sealed now, the ones not named too (the headroom past the prompt,
        # which decode's steps write), so no later BeginWrite can land another prompt's bytes, with tags carrying
        # the owner's own words, on a page decode writes and reads
        pool.begin_write(owner, leases, writer_id)
        return pool.region

    def end_write(self, pool_id: str, owner: bytes, epoch: int, leases: Iterable[Lease], writer_id: str,
                  success: bool, nothing_posted: bool = False, written: tuple | None = None) -> int:
        """written: (num_tokens, checksums, first_token, prompt digest) of a successful write. When, at this instant, every lease
        is the owner's current one and this writer is the one active on it, a write-done notice carrying them goes
        on the pool's revocation log (after any revocation of the owner, before any later one): decode reads on it
        without a Validate call, as the generation is sealed and no other writer can begin on it."""
        # acks may be late, repeated or from a past incarnation: they may only ever undo their own BeginWrite.
        # owner is implied by (page, generation), since every grant takes a fresh generation.
        if epoch != self.epoch:
            return 0
        pool = self._pool(pool_id)
        leases = list(leases)
        if success and written is not None and self._written_by(pool, owner, leases, writer_id):
            pool.revocations.append(owner, epoch, "WRITE_DONE", (tuple(leases), *written))
        num_unquarantined = 0
        # a failed or timed-out write is no proof that nothing is in flight: the transport returns as soon as one
        # task fails or its timer runs out, and flushes nothing. Its pages stay held for lock_delay from now.
        draining = None if success or nothing_posted else f"failed/{writer_id}"
        if draining is not None:
            self._liveness.renew(draining, self._clock())
        for page_id, generation in leases:
            page = pool.pages[page_id] if 0 <= page_id < pool.num_pages else None
            if page is None or page.active_writer != (writer_id, generation):
                continue
            if draining is not None:
                pool.drain_write(page_id, draining)
            elif pool.end_write(page_id, success):
                num_unquarantined += 1
        return num_unquarantined

    @staticmethod
    def _checked(pool: PoolPages, owner: bytes, leases: list[Lease], shares: bool = False) -> list[Page]:
        """pool.checked_pages, but a check of leases an earlier leader granted and nobody handed over is refused as
        EARLIER_TERM_LEASE, and one that comes after decode itself ended the request as OWNER_RELEASED, neither a
        lease violation: a BeginWrite whose caller left while it was on its way (it overlaps the
        forward pass), a re-check sent while the request finished. So only if decode released the owner (or its
        KeepAlive stopped naming it), the owner holds nothing now, and every lease named has ended: its page moved
        on to a later generation, or is free or quarantined at this one, or (shares) cached with the owner no longer
        among its readers. A lease that is live for anyone now is still a violation."""
        try:
            return pool.checked_pages(owner, leases, shares=shares)
        except LeaseError as e:
            if e.reason == "LEASE_NOT_CURRENT" and owner not in pool.owners and all(
                    0 <= p < pool.num_pages and g < pool.first_generation and pool.pages[p].generation != g
                    for p, g in leases):
                # granted by an earlier leader and not handed over (its request had not started decoding, and
                # decode ended it): live for nobody here, its pages waiting out that term's writes
                raise LeaseError("UNAVAILABLE", "EARLIER_TERM_LEASE",
                                 f"{owner.hex()} holds leases an earlier broker leader granted, not handed over at "
                                 f"the failover; nothing may be written for it or read by it ({e.message})") from None
            if e.reason != "LEASE_NOT_CURRENT" or owner not in pool.released or owner in pool.owners:
                raise

            def ended(page: Page, generation: int) -> bool:
                return page.generation > generation or page.generation == generation and (
                    page.state in (PageState.FREE, PageState.QUARANTINED)
                    or shares and page.state is PageState.CACHED and owner not in page.readers)
            if not all(0 <= p < pool.num_pages and ended(pool.pages[p], g) for p, g in leases):
                raise
            raise LeaseError("FAILED_PRECONDITION", "OWNER_RELEASED",
                             f"{owner.hex()} was released by its decode before this check; nothing may be written "
                             f"for it or read by it ({e.message})") from None

    @staticmethod
    def _written_by(pool, owner: bytes, leases: list[Lease], writer_id: str) -> bool:
        """Every lease is owner's current one, and writer_id's write of that generation is the one active on it."""
        try:
            pool.checked_pages(owner, leases, writer_id)
        except LeaseError:
            return False
        return True

    def validate(self, pool_id: str, owner: bytes, epoch: int, leases: Iterable[Lease], recheck: bool = False) -> None:
        """Whether owner may read these pages at these generations. The check before its first read (recheck
        False) passes only pages LEASED to it, and seals them; a re-check of a request that already reads passes
        its shares too (PoolPages.checked_pages): a shared or published page that is still its to read is no
        violation, and failing it would end a healthy request as DATA_LOSS."""
        leases = list(leases)
        pool = self._pool(pool_id, epoch)
        for (page_id, generation), page in zip(leases, self._checked(pool, owner, leases, shares=recheck)):
            if page.state is PageState.LEASED:
                pool.seal_checked(page_id, generation)

    def release(self, pool_id: str, owner: bytes, epoch: int) -> tuple[int, int]:
        if epoch != self.epoch:
            return (0, 0)
        pool = self._pool(pool_id)
        pool.note_released(owner)
        return self._end_leases(pool, owner)

    def revoke(self, pool_id: str, owner: bytes, reason: str) -> tuple[int, int]:
        """Unlike release, the holder has not let go: decode may still be mid-step, writing its own KV into
        these pages, however long that step stalls. So every page goes through quarantine, and lock_delay starts
        only once decode acknowledges that no step of the owner can still run (its KeepAlive no longer lists the
        owner: ReaderFence.acknowledge) or its reader expired (the pool is then fenced for good)."""
        pool = self._pool(pool_id)
        holder = f"revoked/{pool_id}/{owner.hex()}"
        pool.hold_leases(owner, holder)
        held = bool(pool.owners.get(owner))
        # a cached page is never written, so it is not quarantined: only this reader's share ends. Its step may
        # still read the page, though, and what it reads must not be another request's KV by then: the holder
        # pins the page against eviction until the same acknowledgement and lock_delay as the exclusive pages
        counts = self._end_leases(pool, owner, pin=holder)
        event = pool.revocations.append(owner, self.epoch, reason)
        if held:
            self._fence.revoked(pool, owner, holder, event.seq)
        return counts

    def keep_alive_many(self, holder_ids: list[str], ttl_s: float) -> list[str]:
        """One renewal of several holders (a prefill's running writes); returns those refused (a fenced pool's
        writer), which are not renewed while the others are."""
        refused = []
        for holder_id in holder_ids:
            try:
                self.keep_alive(holder_id, ttl_s)
            except LeaseError as e:
                if e.reason != "POOL_FENCED":
                    raise
                refused.append(holder_id)
        return refused

    def keep_alive(self, holder_id: str, ttl_s: float) -> None:
        if not holder_id or not 0 < ttl_s <= self.max_ttl_s:
            raise LeaseError("INVALID_ARGUMENT", "BAD_KEEP_ALIVE",
                             f"holder {holder_id!r}: ttl {ttl_s}s; must be in (0, {self.max_ttl_s}]")
        self._fence.check_writer(self._pools.values(), holder_id)
        self._liveness.renew(holder_id, self._clock() + ttl_s)

    def sweep(self) -> int:
        """Ends writes whose writer is presumed dead; returns the pages that left quarantine."""
        self.expire_readers()  # first: what it revokes waits out lock_delay like any other revocation
        now = self._clock()
        num_freed = 0
        for pool in self._pools.values():
            for page_id in list(pool.cache.pinned):
                pins = pool.pages[page_id].pins
                if pool.unpin(page_id, frozenset(h for h in pins if self._liveness.may_land(h, now))):
                    self._shares.settle(pool, page_id)
            for page_id in list(pool.writing):  # deadlines are not ordered by page or by time: look at all
                writer_id, _ = pool.pages[page_id].active_writer
                # begin_write always leaves a record; should one be missing, wait a full ttl rather than free now
                if not self._liveness.may_land(writer_id, now) and pool.end_write(page_id, success=False):
                    num_freed += 1
        # a holder this far past its expiry blocks nothing any more (its writes were just ended)
        self._liveness.prune(now)
        return num_freed

    def reader_keep_alive(self, pool_id: str, held_owners: Iterable[bytes], revocations_seen: int = 0) -> list[bytes]:
        """Renews the pool's reader and revokes the owners it does not hold (ReaderFence.keep_alive); returns those
        owners. revocations_seen: the seq of the last revocation decode had processed when it listed held_owners; a
        revoked owner up to it that decode no longer holds is acknowledged (no step of it can still run)."""
        self._fence.check_not_forgotten(pool_id)
        pool = self._pool(pool_id)
        held = set(held_owners)
        stale = self._fence.keep_alive(pool, held)
        for owner in stale:
            pool.note_released(owner)  # decode's own word that it let go: a Release that was lost
            self.revoke(pool_id, owner, NOT_HELD)
        self._fence.acknowledge_absent(pool, held, revocations_seen)
        return stale

    def expire_readers(self) -> int:
        """Revokes every lease of each pool whose reader's record has expired; returns the owners revoked."""
        now = self._clock()
        num_revoked = 0
        for pool in self._pools.values():
            if not self._fence.is_fenced(pool, now):
                continue
            for owner in list(pool.owners):
                self.revoke(pool.pool_id, owner, READER_EXPIRED)
                num_revoked += 1
            for owner in list(pool.unacked):  # a fenced pool is never granted from again
                self._fence.acknowledge(pool, owner, min(now, pool.reader_expiry))
        return num_revoked

    def forget_pools(self) -> list[str]:
        """Forgets each pool fenced at least lock_delay ago that has no page leased, quarantined or under a
        writer any more; returns their ids."""
        gone = self._fence.forgettable(self._pools.values())
        for pool_id in gone:
            del self._pools[pool_id]
            self._fence.forgotten(pool_id)
        return gone

    def last_seq(self, pool_id: str) -> int:
        return self._pool(pool_id).revocations.last_seq

    def revocations_since(self, pool_id: str, after_seq: int):
        """(revocations with seq > after_seq, whether the log lost some of them, the pool's last seq)."""
        log = self._pool(pool_id).revocations
        events, gap = log.since(after_seq)
        return events, gap, log.last_seq

    def publish(self, pool_id: str, owner: bytes, epoch: int, leases: Iterable[Lease], chains: Sequence[bytes],
                checksums: Sequence[int], scope_tag: bytes) -> list[bool]:
        """Per page, whether it is CACHED now, its owner the first reader. Only the owner's current lease of a
        generation a writer's successful EndWrite (or decode's Validate) covered, sealed, with no writer active,
        and of a chain not cached yet; any other page stays the owner's own (False)."""
        leases, chains, checksums = PrefixShares.check_publish(owner, leases, chains, checksums, scope_tag)
        pool = self._pool(pool_id, epoch)
        self._fence.check(pool)
        return self._shares.publish(pool, owner, leases, chains, checksums, scope_tag)

    def unpublish(self, pool_id: str, owner: bytes, epoch: int, leases: Iterable[Lease], reason: str) -> int:
        """A reader found these cached pages bad: no later Grant finds them, and each leaves through quarantine
        once its last reader is gone (PrefixShares.unpublish). A stale epoch is a no-op, as for Release."""
        check_owner(owner)
        if epoch != self.epoch:
            return 0
        return self._shares.unpublish(self._pool(pool_id), owner, leases, reason)

    def pool_state(self, pool_id: str) -> dict[str, int]:
        pool = self._pool(pool_id)
        num_reads = pool.cache.num_reads
        return {"epoch": self.epoch, "num_pages": pool.num_pages, "num_free": len(pool.free) + len(pool.parked),
                "num_parked": len(pool.parked),
                # an owner's list holds its shared pages too, one entry per reader's share
                "num_leased": sum(len(p) for p in pool.owners.values()) - num_reads,
                "num_quarantined": len(pool.quarantined), "num_writing": len(pool.writing),
                "num_cached": len(pool.cache.cached), "num_shared_reads": num_reads,
                "num_evictable": len(pool.cache.lru)}

    def num_unread_cached(self, pool_id: str) -> int:
        """Cached pages nobody reads or pins: what a short Grant or Extend may evict."""
        return len(self._pool(pool_id).cache.lru)

    def leases_of(self, pool_id: str, owner: bytes) -> list[Lease]:
        pool = self._pool(pool_id)
        return [(page_id, pool.pages[page_id].generation) for page_id in pool.owners.get(owner, [])]

    def page_info(self, pool_id: str, page_id: int) -> Page:  # a copy, for tests and debugging
        return replace(self._pool(pool_id).pages[page_id])  # its sets are frozen: nothing of it is shared

    def pool_ids(self) -> list[str]:
        return list(self._pools)

    def _pool(self, pool_id: str, epoch: int | None = None) -> PoolPages:
        # epoch first: after a restart the pool is unknown too, and "epoch changed" is what the caller must learn
        if epoch is not None and epoch != self.epoch:
            raise LeaseError("FAILED_PRECONDITION", "EPOCH_MISMATCH", f"epoch {epoch} is not current {self.epoch}")
        if (pool := self._pools.get(pool_id)) is None:
            raise LeaseError("NOT_FOUND", "UNKNOWN_POOL", f"pool {pool_id!r} is not one of {len(self._pools)} pools")
        return pool

    def _end_leases(self, pool: PoolPages, owner: bytes, pin: str | None = None) -> tuple[int, int]:
        """(pages freed, pages quarantined); a cached page the owner read is neither: only its share ends (pin:
        the holder that keeps the page from eviction for as long as a step of the owner may still read it)."""
        num_freed = num_quarantined = 0
        for page_id in pool.end_owner(owner):
            if pool.pages[page_id].state is PageState.CACHED:
                pool.end_share(page_id, owner, pin)
                self._shares.settle(pool, page_id)
            elif pool.end_lease(page_id, owner):
                num_freed += 1
            else:
                num_quarantined += 1
        return (num_freed, num_quarantined)
