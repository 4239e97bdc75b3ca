"""Prefix reuse in the lease table (a mixin of LeaseTable; docs/design.md §8): Publish turns an owner's
written, checked pages into CACHED pages, read-only to a set of readers; Grants share the longest cached run of
their prefix chain under their own scope tag; short Grants and Extends evict unread cached pages, least recently read
first; Unpublish takes pages found bad out of the index, and they leave through quarantine once unread.

The rules of exclusive pages are untouched: a cached page is never LEASED, so no BeginWrite, EndWrite or
Validate names it (PoolPages.checked_pages), and it is freed only unread and unpinned."""
from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, Iterable, Sequence

from .pages import Lease, LeaseError, PageState, PoolPages, check_owner, check_prefix_args

log = logging.getLogger(__name__)
MAX_REASON_CHARS = 64  # an Unpublish reason is the caller's free text: logged, bounded


class PrefixLeases:
    # set by LeaseTable.__init__; _pool and check_reader are LeaseTable's
    prefix_counts: Counter[str]
    epoch: int
    _clock: Callable[[], float]
    _liveness: dict[str, float]

    def take_prefix_counts(self) -> Counter[str]:
        """The prefix cache events since the last call (hits, published, evicted_lru, evicted_corrupt,
        cross_scope)."""
        counts, self.prefix_counts = self.prefix_counts, Counter()
        return +counts  # without the zero entries

    def publish(self, pool_id: str, owner: bytes, epoch: int, leases: Iterable[Lease], chains: Sequence[bytes],
                checksums: Sequence[int], scope_tag: bytes) -> list[bool]:
        """Per page, whether it is CACHED now, its owner the first reader. Only the owner's current lease of a
        generation a writer's successful EndWrite (or decode's Validate) covered, sealed, with no writer active,
        and of a chain not cached yet; any other page stays the owner's own (False)."""
        check_owner(owner)
        leases, chains, checksums = list(leases), list(chains), list(checksums)
        if not len(leases) == len(chains) == len(checksums):
            raise LeaseError("INVALID_ARGUMENT", "BAD_PUBLISH", f"{len(leases)} leases, {len(chains)} chains and "
                                                                f"{len(checksums)} checksums: one of each per page")
        check_prefix_args(chains, scope_tag, "chains")
        if not scope_tag:
            raise LeaseError("INVALID_ARGUMENT", "BAD_SCOPE_TAG", "publish needs the owner's scope_tag; none given")
        if bad := [c for c in checksums if not 0 <= c < 2**32]:
            raise LeaseError("INVALID_ARGUMENT", "BAD_CHECKSUM",
                             f"{len(bad)} checksums are not CRC-32C values, e.g. {bad[0]}")
        pool = self._pool(pool_id, epoch)
        self.check_reader(pool)
        published = []
        for (page_id, generation), chain, checksum in zip(leases, chains, checksums):
            page = pool.pages[page_id] if 0 <= page_id < pool.num_pages else None
            ok = (page is not None and page.state is PageState.LEASED and page.owner == owner
                  and page.generation == page.sealed_generation == page.written_generation == generation
                  and page.active_writer is None and pool.cache.find(chain) is None)
            if ok:
                page.state, page.owner, page.readers = PageState.CACHED, None, frozenset((owner,))
                page.chain, page.checksum, page.scope_tag = chain, checksum, scope_tag
                pool.cache.add(page_id, chain)
                pool.cache.num_reads += 1
            published.append(ok)
        self.prefix_counts["published"] += sum(published)
        return published

    def unpublish(self, pool_id: str, owner: bytes, epoch: int, leases: Iterable[Lease], reason: str) -> int:
        """A reader found these cached pages bad: no later Grant finds them, and each leaves through quarantine
        once its last reader is gone. Returns the pages taken out of the index by this call. A page the owner
        does not read at that generation, or one already out of the index, is skipped, not refused: the caller's
        other pages must still go. A stale epoch is a no-op, as for Release."""
        check_owner(owner)
        if epoch != self.epoch:
            return 0
        pool = self._pool(pool_id)
        num = 0
        for page_id, generation in leases:
            page = pool.pages[page_id] if 0 <= page_id < pool.num_pages else None
            if (page is None or page.state is not PageState.CACHED or owner not in page.readers
                    or page.generation != generation or not pool.cache.is_indexed(page_id, page.chain)):
                continue
            pool.cache.unindex(page_id, page.chain)
            num += 1
        if num:
            self.prefix_counts["evicted_corrupt"] += num
            log.warning("pool %s: %d cached pages unpublished by %s (%s)", pool_id, num, owner.hex(),
                        reason[:MAX_REASON_CHARS])
        return num

    def _shared_run(self, pool: PoolPages, chains: Sequence[bytes], scope_tag: bytes) -> list[int]:
        run: list[int] = []
        seen: set[int] = set()  # a list's `in` would make a 65,536-page prompt's run quadratic
        for chain in chains:
            page_id = pool.cache.find(chain)
            if page_id is None or page_id in seen:
                break
            seen.add(page_id)
            if pool.pages[page_id].scope_tag != scope_tag:
                # the chain covers the scope too: a match under another scope's tag is a collision or a caller
                # that left the scope out of its chain, and must never hand one tenant's KV to another
                self.prefix_counts["cross_scope"] += 1
                log.warning("pool %s: chain %s is cached under another scope tag (page %s); not shared",
                            pool.pool_id, chain.hex(), page_id)
                break
            run.append(page_id)
        return run

    def _make_room(self, pool: PoolPages, num_needed: int, keep: list[int], what: str) -> None:
        """Evicts unread cached pages (least recently read first, none of keep) until num_needed pages are
        free, or refuses without evicting any when even that would not be enough."""
        num_short = num_needed - len(pool.free)
        if num_short <= 0:
            return
        num_evictable = pool.cache.num_evictable(keep)
        if num_evictable < num_short:
            raise LeaseError("RESOURCE_EXHAUSTED", "POOL_EXHAUSTED",
                             f"pool {pool.pool_id} has {len(pool.free)} free pages of {pool.num_pages}; {what}, "
                             f"and {num_evictable} unread cached pages to evict")
        for page_id in pool.cache.victims(num_short, keep):
            pool.cache.drop(page_id, pool.pages[page_id].chain)
            pool.free_page(page_id)  # unread, never written again, no writer: nothing can still reach it
        self.prefix_counts["evicted_lru"] += num_short

    def _settle(self, pool: PoolPages, page_id: int) -> None:
        """A cached page nobody reads or pins any more joins the LRU (most recent end), or, once unpublished,
        goes through quarantine: the corruption that got it unpublished may be a stray write still landing."""
        page = pool.pages[page_id]
        if page.readers or page.pins:
            return
        if pool.cache.is_indexed(page_id, page.chain):
            pool.cache.mark_unread(page_id)
            return
        pool.cache.drop(page_id, page.chain)
        holder = f"unpublished/{pool.pool_id}"
        self._liveness[holder] = self._clock()  # its liveness ends now: the sweep frees the page lock_delay later
        page.state, page.active_writer = PageState.QUARANTINED, (holder, page.generation)
        pool.quarantined.add(page_id)
        pool.writing.add(page_id)
