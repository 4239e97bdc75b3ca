"""Prefix shares (docs/design.md §8): Publish turns an owner's written, checked pages into CACHED pages, read-only to
a set of readers; Grants share the longest cached run of their prefix chain under their own scope tag; short Grants
and Extends evict unread cached pages, least recently read first; Unpublish takes pages found bad out of the index,
and they leave through quarantine once unread.

PrefixShares owns the prefix cache events counted since they were last taken, and decides which pages a Grant
shares and which it evicts; each page changes through its pool (PoolPages). LeaseTable looks the pool up and checks
its reader before calling here. The rules of exclusive pages are untouched: a cached page is never LEASED, so no
BeginWrite, EndWrite or Validate names it (PoolPages.checked_pages), and it is freed only unread and unpinned."""
from __future__ import annotations

import logging
from collections import Counter
from typing import Iterable, Sequence

from .liveness import Liveness
from .pages import Lease, LeaseError, PoolPages, check_owner, check_prefix_args

log = logging.getLogger(__name__)
MAX_REASON_CHARS = 64  # an Unpublish reason is the caller's free text: logged, bounded


class PrefixShares:
    def __init__(self, liveness: Liveness) -> None:
        self._liveness = liveness
        self._counts: Counter[str] = Counter()

    def take_counts(self) -> Counter[str]:
        """The prefix cache events since the last call (hits, published, evicted_lru, evicted_corrupt,
        cross_scope)."""
        counts, self._counts = self._counts, Counter()
        return +counts  # without the zero entries

    @staticmethod
    def check_publish(owner: bytes, leases: Iterable[Lease], chains: Sequence[bytes], checksums: Sequence[int],
                      scope_tag: bytes) -> tuple[list[Lease], list[bytes], list[int]]:
        """A Publish's arguments as lists, or why they are refused (before the pool is looked up)."""
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
        return leases, chains, checksums

    def publish(self, pool: PoolPages, owner: bytes, leases: list[Lease], chains: list[bytes], checksums: list[int],
                scope_tag: bytes) -> list[bool]:
        """Per page, whether it is CACHED now, its owner the first reader (PoolPages.publish says which may be);
        any other page stays the owner's own (False)."""
        published = [pool.publish(page_id, owner, generation, chain, checksum, scope_tag)
                     for (page_id, generation), chain, checksum in zip(leases, chains, checksums)]
        self._counts["published"] += sum(published)
        return published

    def unpublish(self, pool: PoolPages, owner: bytes, leases: Iterable[Lease], reason: str) -> int:
        """A reader found these cached pages bad: no later Grant finds them. Returns the pages taken out of the
        index by this call; a page the owner does not read at that generation, or one already out of the index,
        is skipped, not refused: the caller's other pages must still go."""
        num = sum(pool.unpublish(page_id, owner, generation) for page_id, generation in leases)
        if num:
            self._counts["evicted_corrupt"] += num
            log.warning("pool %s: %d cached pages unpublished by %s (%s)", pool.pool_id, num, owner.hex(),
                        reason[:MAX_REASON_CHARS])
        return num

    def shared_run(self, pool: PoolPages, chains: Sequence[bytes], scope_tag: bytes) -> list[int]:
        """The cached pages of the longest run of chains, from the first, indexed under scope_tag."""
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
                self._counts["cross_scope"] += 1
                log.warning("pool %s: chain %s is cached under another scope tag (page %s); not shared",
                            pool.pool_id, chain.hex(), page_id)
                break
            run.append(page_id)
        return run

    def share(self, pool: PoolPages, owner: bytes, page_ids: list[int]) -> None:
        pool.share(owner, page_ids)
        self._counts["hits"] += len(page_ids)

    def make_room(self, pool: PoolPages, num_needed: int, keep: list[int], what: str) -> None:
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
            pool.evict(page_id)
        self._counts["evicted_lru"] += num_short

    def settle(self, pool: PoolPages, page_id: int) -> None:
        """A cached page nobody reads or pins any more (PoolPages.settle); one that goes to quarantine has its
        holder's liveness end now, so the sweep frees it lock_delay later."""
        holder = f"unpublished/{pool.pool_id}"
        if pool.settle(page_id, holder):
            self._liveness.end(holder)
