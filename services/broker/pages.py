"""Page and pool state of the broker's lease table (docs/design.md §3, "Leases"), and the errors its operations
raise. PoolPages is the one owner of a pool's pages: every change of a page (its state, owner, generation, writer,
seal, pins, readers) and of the sets kept in step with them (the free heap, `writing`, `quarantined`, the prefix
cache, the owners' lists) is one of its methods. Each checks its precondition before it changes anything and raises
PageStateError, a broker bug rather than a refusal, when it does not hold; which transition to make, and when, is
decided by LeaseTable and its parts.

Kept in step by these methods: a page is FREE iff it is in `free` (grantable) or in `parked` (in the leader's
durable free set in etcd: never granted until unparked, free_set.py); in `quarantined` iff QUARANTINED; in `writing`
iff it has an active writer, whose generation is the page's; a FREE or CACHED page has no writer. A CACHED page
(prefix reuse) has no owner: it is leased read-only to a set of readers (owners whose lease lists hold it), is never
written again, and is found by its chain key in the pool's PrefixCache."""

import enum
import heapq
from collections import OrderedDict
from dataclasses import dataclass, field
from .prefix_cache import PrefixCache
from .revocation_log import Revocation, RevocationLog

OWNER_NBYTES = 16
# owners a pool remembers as released by its decode: a BeginWrite or re-check that comes later is a stale call of a
# request that ended, refused as OWNER_RELEASED (no violation; LeaseTable._checked). Beyond this many, the oldest is
# forgotten, and a call as late as that counts as a violation again
RELEASED_MEMORY = 16384
Lease = tuple[int, int]  # (page, generation)
PageState = enum.Enum("PageState", ["FREE", "LEASED", "QUARANTINED", "CACHED"])
__all__ = ["CHAIN_NBYTES", "OWNER_NBYTES", "SCOPE_TAG_NBYTES", "Lease", "LeaseError", "Page", "PageState",
           "PageStateError", "PoolPages", "Revocation"]


class LeaseError(Exception):
    """A refused operation. kind: INVALID_ARGUMENT, RESOURCE_EXHAUSTED, FAILED_PRECONDITION, NOT_FOUND or
    ALREADY_EXISTS (the gRPC status code it maps to); reason: machine-readable, UPPER_SNAKE."""

    def __init__(self, kind: str, reason: str, message: str):
        super().__init__(message)
        self.kind, self.reason, self.message = kind, reason, message


class PageStateError(RuntimeError):
    """A page transition asked of a page whose state does not allow it: a bug of the broker, never a client's
    fault. Raised before anything changes, so the call fails (closed) and the table stays as it was."""


@dataclass(slots=True)
class Page:
    state: PageState = PageState.FREE
    owner: bytes | None = None
    generation: int = 0  # kept when FREE: the next grant must take a larger one
    active_writer: tuple[str, int] | None = None  # (writer_id, generation)
    # a lease generation is written at most once: BeginWrite of this generation is refused from the first
    # BeginWrite or decode's Validate on (a retry or replay would rewrite pages decode already checked)
    sealed_generation: int = 0
    # the generation a writer's successful EndWrite (or decode's Validate) covered: only such a page is ever
    # cached, so a failed, abandoned or never-begun write stays out of every later lookup
    written_generation: int = 0
    # CACHED only: owners reading it, the broker's holders of revoked readers whose step may still read it (it is
    # not evicted until they end), and what its publisher said it is
    readers: frozenset[bytes] = frozenset()
    pins: frozenset[str] = frozenset()
    chain: bytes = b""
    checksum: int = 0
    scope_tag: bytes = b""


@dataclass(slots=True)
class PoolPages:
    pool_id: str
    num_pages: int
    pages: list[Page] = field(init=False)
    free: list[int] = field(init=False)  # min-heap, so grants come out contiguous whenever the pool allows it
    parked: set[int] = field(default_factory=set)  # FREE pages in the durable free set: not grantable
    owners: dict[bytes, list[int]] = field(default_factory=dict)
    quarantined: set[int] = field(default_factory=set)
    writing: set[int] = field(default_factory=set)
    next_generation: int = 1  # 0 is proto3's "unset" and never names a lease
    generation_limit: int = 2**63  # the first generation this table may not grant (the next term's first)
    first_generation: int = field(init=False)  # this table's term's first: a lease below it is an earlier leader's
    revocations: RevocationLog = field(default_factory=RevocationLog)
    granted_at: dict[bytes, float] = field(default_factory=dict)  # owner -> clock at its grant
    reader_expiry: float = float("inf")  # the pool's decode renews it; set at registration
    region: object = None  # where decode registered the pool's bytes (opaque here; a PoolRegion message)
    # revoked owners whose pages wait for the reader's acknowledgement: owner -> (quarantine holder, revocation seq)
    unacked: dict[bytes, tuple[str, int]] = field(default_factory=dict)
    cache: PrefixCache = field(default_factory=PrefixCache)
    released: OrderedDict = field(default_factory=OrderedDict)  # owner -> None, oldest first (RELEASED_MEMORY)

    def __post_init__(self) -> None:
        self.first_generation = self.next_generation
        self.pages = [Page() for _ in range(self.num_pages)]
        self.free = list(range(self.num_pages))  # sorted, hence already a valid heap

    def note_released(self, owner: bytes) -> None:
        self.released[owner] = None
        self.released.move_to_end(owner)
        if len(self.released) > RELEASED_MEMORY:
            self.released.popitem(last=False)


    def checked_pages(self, owner: bytes, leases: list[Lease], writer_id: str | None = None,
                      shares: bool = False) -> list[Page]:
        """The pages of leases, if every one is current and has no active writer (with writer_id: its write of that
        generation is the active one, what a write-done notice stands for). shares: a page the owner reads as a
        share is current too, CACHED at that generation with the owner among its readers (what a request that
        shares or published pages holds; a revoked or released reader is no longer among them, and an evicted page
        comes back at a new generation)."""
        check_owner(owner)
        if not leases:
            raise LeaseError("INVALID_ARGUMENT", "NO_LEASES", "at least 1 lease is required; 0 given")
        if len({page_id for page_id, _ in leases}) != len(leases):
            raise LeaseError("INVALID_ARGUMENT", "DUPLICATE_PAGE", f"{len(leases)} leases name a page twice")
        pages = []
        for page_id, generation in leases:
            if not 0 <= page_id < self.num_pages:
                raise LeaseError("INVALID_ARGUMENT", "PAGE_OUT_OF_RANGE",
                                 f"page {page_id} is outside pool {self.pool_id} of {self.num_pages} pages")
            page = self.pages[page_id]
            if shares and page.state is PageState.CACHED and page.generation == generation and owner in page.readers:
                pages.append(page)
                continue
            if page.state is not PageState.LEASED or page.owner != owner or page.generation != generation:
                raise LeaseError("FAILED_PRECONDITION", "LEASE_NOT_CURRENT",
                                 f"page {page_id} generation {generation} is not leased to {owner.hex()} "
                                 f"(page is {page.state.name} at generation {page.generation})")
            pages.append(page)
        for (page_id, generation), page in zip(leases, pages):
            if page.active_writer != (None if writer_id is None else (writer_id, generation)):
                raise LeaseError("FAILED_PRECONDITION", "WRITER_ACTIVE",
                                 f"page {page_id} generation {generation} is being written by {page.active_writer}")
        return pages



    def new_generation(self) -> int:
        if self.next_generation >= self.generation_limit:
            raise PageStateError(f"pool {self.pool_id}: generations of this term are used up at "
                                 f"{self.generation_limit}; the next term's begin there")
        generation, self.next_generation = self.next_generation, self.next_generation + 1
        return generation

    def open_owner(self, owner: bytes, now: float) -> None:
        """owner starts holding leases here (granted at now). Pre: it holds none."""
        if owner in self.owners:
            raise PageStateError(f"pool {self.pool_id}: owner {owner.hex()} is open already")
        self.owners[owner] = []
        self.granted_at[owner] = now

    def share(self, owner: bytes, page_ids: list[int]) -> None:
        """owner reads these cached pages read-only; they join its list. Pre: owner is open, each page CACHED."""
        self._expect(page_ids, "CACHED", lambda page: page.state is PageState.CACHED)
        held = self._held(owner)
        for page_id in page_ids:
            page = self.pages[page_id]
            page.readers = page.readers | {owner}
            self.cache.mark_read(page_id)
        self.cache.num_reads += len(page_ids)
        held.extend(page_ids)

    def lease(self, owner: bytes, num: int, generation: int, sealed: bool = False) -> list[int]:
        """Leases the num lowest free pages (ascending: from a min-heap) to owner at generation, and adds them to
        its list; sealed: no BeginWrite may ever name them (growth pages, written by decode's steps alone).
        Pre: owner is open and num pages are free."""
        held = self._held(owner)
        if num > len(self.free):
            raise PageStateError(f"pool {self.pool_id}: {num} pages to lease, {len(self.free)} free")
        taken = [heapq.heappop(self.free) for _ in range(num)]
        if any(self.pages[page_id].state is not PageState.FREE for page_id in taken):
            for page_id in taken:
                heapq.heappush(self.free, page_id)
            self._expect(taken, "FREE", lambda page: page.state is PageState.FREE)
        for page_id in taken:
            page = self.pages[page_id]
            page.state, page.owner, page.generation = PageState.LEASED, owner, generation
            if sealed:
                page.sealed_generation = generation
        held.extend(taken)
        return taken

    def begin_write(self, owner: bytes, leases: list[Lease], writer_id: str) -> None:
        """writer_id's write of these leases is active on their pages, and every page of owner's at one of their
        generations is sealed: a grant's generation is written once, by one prefill, its headroom past the prompt
        (decode's steps write it) included. Pre: each page LEASED at that generation with no writer."""
        self._expect([page_id for page_id, _ in leases], "LEASED with no writer",
                     lambda page: page.state is PageState.LEASED and page.active_writer is None)
        for page_id, generation in leases:
            self.pages[page_id].active_writer = (writer_id, generation)
            self.writing.add(page_id)
        generations = {generation for _, generation in leases}
        for page_id in self.owners.get(owner, ()):
            if (page := self.pages[page_id]).generation in generations:
                page.sealed_generation = page.generation

    def drain_write(self, page_id: int, holder: str) -> None:
        """The active write failed after posting: holder stands in for its writer, at its generation, until its
        bytes can no longer land. Pre: a writer is active."""
        self._expect([page_id], "under a writer", lambda page: page.active_writer is not None)
        page = self.pages[page_id]
        page.active_writer = (holder, page.active_writer[1])

    def end_write(self, page_id: int, success: bool) -> bool:
        """The active writer is done (acknowledged, or presumed dead); success: its generation counts as written.
        A page that waited in quarantine at that generation is freed; returns whether it was. Pre: a writer is
        active."""
        self._expect([page_id], "under a writer", lambda page: page.active_writer is not None)
        page = self.pages[page_id]
        _, generation = page.active_writer
        page.active_writer = None
        self.writing.discard(page_id)
        if success:
            page.written_generation = generation
        if page.state is PageState.QUARANTINED and page.generation == generation:
            self._free(page_id)
            return True
        return False

    def seal_checked(self, page_id: int, generation: int) -> None:
        """Decode checked the page's bytes: no writer may begin on this generation again, and it counts as
        written. Pre: LEASED at that generation."""
        self._expect([page_id], f"LEASED at generation {generation}",
                     lambda page: page.state is PageState.LEASED and page.generation == generation)
        page = self.pages[page_id]
        page.sealed_generation = page.written_generation = generation

    def hold_leases(self, owner: bytes, holder: str) -> None:
        """holder stands in as the writer of each page owner leases that has none (a revoked owner's step may
        still write it), until the revocation is acknowledged and lock_delay has passed."""
        for page_id in self.owners.get(owner, ()):
            page = self.pages[page_id]
            if page.state is PageState.LEASED and page.active_writer is None:
                page.active_writer = (holder, page.generation)
                self.writing.add(page_id)

    def end_owner(self, owner: bytes) -> list[int]:
        """owner holds nothing here any more; returns the pages it held, each still to end with end_lease or
        end_share."""
        self.granted_at.pop(owner, None)
        return self.owners.pop(owner, [])

    def end_lease(self, page_id: int, owner: bytes) -> bool:
        """An exclusive lease of owner's ends: the page is freed, or quarantined while a writer may still land bytes
        on it (until it acks or is presumed dead). Returns whether it was freed. Pre: LEASED to owner."""
        self._expect([page_id], f"LEASED to {owner.hex()}",
                     lambda page: page.state is PageState.LEASED and page.owner == owner)
        page = self.pages[page_id]
        page.owner = None
        if page.active_writer is None:
            self._free(page_id)
            return True
        page.state = PageState.QUARANTINED
        self.quarantined.add(page_id)
        return False

    def end_share(self, page_id: int, owner: bytes, pin: str | None) -> None:
        """owner reads the cached page no more; pin: a holder that keeps it from eviction while a step of owner's
        may still read it. Settle it next. Pre: CACHED, owner among its readers."""
        self._expect([page_id], f"CACHED and read by {owner.hex()}",
                     lambda page: page.state is PageState.CACHED and owner in page.readers)
        page = self.pages[page_id]
        page.readers = page.readers - {owner}
        self.cache.num_reads -= 1
        if pin is not None:
            page.pins = page.pins | {pin}
            self.cache.pinned.add(page_id)

    def unpin(self, page_id: int, pins: frozenset[str]) -> bool:
        """The page's pins are now `pins` (those of its holders that may still read it); returns whether none is
        left, and the page is then unpinned (settle it next). Pre: CACHED."""
        self._expect([page_id], "CACHED", lambda page: page.state is PageState.CACHED)
        self.pages[page_id].pins = pins
        if pins:
            return False
        self.cache.pinned.discard(page_id)
        return True

    def publish(self, page_id: int, owner: bytes, generation: int, chain: bytes, checksum: int,
                scope_tag: bytes) -> bool:
        """Whether the page is CACHED now under chain, owner its first reader; nothing changes unless it is owner's
        current lease at generation, written and sealed at it (a writer's successful EndWrite or decode's Validate),
        with no writer active, and no page is cached under chain yet."""
        page = self.pages[page_id] if 0 <= page_id < self.num_pages else None
        if not (page is not None and page.state is PageState.LEASED and page.owner == owner
                and page.generation == page.sealed_generation == page.written_generation == generation
                and page.active_writer is None and self.cache.find(chain) is None):
            return False
        page.state, page.owner, page.readers = PageState.CACHED, None, frozenset((owner,))
        page.chain, page.checksum, page.scope_tag = chain, checksum, scope_tag
        self.cache.add(page_id, chain)
        self.cache.num_reads += 1
        return True

    def unpublish(self, page_id: int, owner: bytes, generation: int) -> bool:
        """Whether the page left the chain index now (no later Grant finds it; it leaves once unread): only a
        CACHED page owner reads at generation, still indexed."""
        page = self.pages[page_id] if 0 <= page_id < self.num_pages else None
        if (page is None or page.state is not PageState.CACHED or owner not in page.readers
                or page.generation != generation or not self.cache.is_indexed(page_id, page.chain)):
            return False
        self.cache.unindex(page_id, page.chain)
        return True

    def evict(self, page_id: int) -> None:
        """An unread cached page is freed at once: never written again, no writer, nobody reads or pins it, so
        nothing can still reach it. Pre: in the LRU (CACHED, indexed, unread, unpinned)."""
        self._expect([page_id], "CACHED and unread",
                     lambda page: page.state is PageState.CACHED and page_id in self.cache.lru)
        self.cache.drop(page_id, self.pages[page_id].chain)
        self._free(page_id)

    def settle(self, page_id: int, holder: str) -> bool:
        """A cached page nobody reads or pins any more joins the LRU (most recent end) while indexed; unpublished,
        it goes to quarantine under holder (the corruption that got it unpublished may be a stray write still
        landing). Returns whether it was quarantined. Pre: CACHED."""
        self._expect([page_id], "CACHED", lambda page: page.state is PageState.CACHED)
        page = self.pages[page_id]
        if page.readers or page.pins:
            return False
        if self.cache.is_indexed(page_id, page.chain):
            self.cache.mark_unread(page_id)
            return False
        self.cache.drop(page_id, page.chain)
        page.state, page.active_writer = PageState.QUARANTINED, (holder, page.generation)
        self.quarantined.add(page_id)
        self.writing.add(page_id)
        return True

    def hold(self, page_ids: list[int], writer: str) -> None:
        """Quarantines pages a writer of an earlier epoch may still reach (the broker restarted). Pre: FREE."""
        self._expect(page_ids, "FREE", lambda page: page.state is PageState.FREE)
        for page_id in page_ids:
            page = self.pages[page_id]
            page.state, page.active_writer = PageState.QUARANTINED, (writer, 0)
            self.quarantined.add(page_id)
            self.writing.add(page_id)
        self.free = [i for i in self.free if i not in self.quarantined]
        heapq.heapify(self.free)

    def park(self, num: int) -> list[int]:
        """Up to num grantable pages, the highest first, leave the heap for the durable free set (written next).
        Pre: none. They are FREE and never granted while parked."""
        num = min(num, len(self.free))
        taken = heapq.nlargest(num, self.free)
        gone = set(taken)
        self.free = [i for i in self.free if i not in gone]
        heapq.heapify(self.free)
        self.parked |= gone
        return taken

    def unpark(self, page_ids: list[int]) -> None:
        """Parked pages a write of the durable free set no longer holds become grantable. Pre: parked."""
        self._expect(page_ids, "parked", lambda page: page.state is PageState.FREE)
        if missing := [i for i in page_ids if i not in self.parked]:
            raise PageStateError(f"pool {self.pool_id}: pages {missing[:4]} are not parked")
        self.parked -= set(page_ids)
        for page_id in page_ids:
            heapq.heappush(self.free, page_id)

    def adopt(self, claims: list[tuple[bytes, list[Lease], list[bool]]], holder: str, now: float,
              parked: set[int] = frozenset()) -> None:
        """A pool handed over at a failover (LeaseTable.adopt_pool): each claimed exclusive lease is LEASED to its
        owner at its generation, sealed and written (decode verified it; no BeginWrite names it again); each page
        claimed as cached is CACHED at its generation, read by its claimants, unindexed (no later Grant shares it);
        a page of the durable free set (`parked`: no earlier leader could grant it) stays FREE and parked; every
        other page is QUARANTINED under holder, as an earlier term's write may still land on it. A claim that
        contradicts itself, or the free set, is refused whole (LeaseError) before anything changes. Pre: a fresh
        pool."""
        if self.owners or len(self.free) != self.num_pages:
            raise PageStateError(f"pool {self.pool_id}: only a fresh pool is adopted")
        if bad := [i for i in parked if not 0 <= i < self.num_pages]:
            raise _bad_claim(f"the durable free set of pool {self.pool_id} names pages {sorted(bad)[:4]} outside "
                             f"its {self.num_pages}")
        own: dict[int, tuple[bytes, int]] = {}
        cached: dict[int, tuple[int, frozenset[bytes]]] = {}
        lists: dict[bytes, list[int]] = {}
        for owner, leases, flags in claims:
            check_owner(owner)
            if owner in lists or len(flags) != len(leases) or not leases:
                raise _bad_claim(f"owner {owner.hex()} is claimed twice, or with {len(leases)} leases and "
                                 f"{len(flags)} cached flags")
            lists[owner] = []
            for (page_id, generation), is_cached in zip(leases, flags):
                if not 0 <= page_id < self.num_pages or not 0 < generation < self.next_generation:
                    raise _bad_claim(f"page {page_id} generation {generation} of {owner.hex()}: pages are in "
                                     f"[0, {self.num_pages}), earlier terms' generations in [1, {self.next_generation})")
                seen = cached.get(page_id, (generation, frozenset()))
                if page_id in parked:
                    raise _bad_claim(f"page {page_id} is claimed by {owner.hex()} but is in the durable free set")
                if page_id in own or (page_id in cached and (not is_cached or seen[0] != generation)) \
                        or owner in seen[1]:
                    raise _bad_claim(f"page {page_id} is claimed by {owner.hex()} at generation {generation} "
                                     f"({'cached' if is_cached else 'its own'}) and by another claim")
                if is_cached:
                    cached[page_id] = (generation, seen[1] | {owner})
                else:
                    own[page_id] = (owner, generation)
                lists[owner].append(page_id)
        self.owners = lists
        for owner in lists:
            self.granted_at[owner] = now
        for page_id, (owner, generation) in own.items():
            page = self.pages[page_id]
            page.state, page.owner, page.generation = PageState.LEASED, owner, generation
            page.sealed_generation = page.written_generation = generation
        for page_id, (generation, readers) in cached.items():
            page = self.pages[page_id]
            page.state, page.generation, page.readers = PageState.CACHED, generation, readers
            page.sealed_generation = page.written_generation = generation
            self.cache.cached.add(page_id)
            self.cache.num_reads += len(readers)
        self.parked = set(parked)
        for page_id, page in enumerate(self.pages):
            if page.state is PageState.FREE and page_id not in self.parked:
                page.state, page.active_writer = PageState.QUARANTINED, (holder, 0)
                self.quarantined.add(page_id)
                self.writing.add(page_id)
        self.free = []

    def _free(self, page_id: int) -> None:
        page = self.pages[page_id]
        page.state, page.owner = PageState.FREE, None
        page.readers, page.pins, page.chain, page.checksum, page.scope_tag = frozenset(), frozenset(), b"", 0, b""
        self.quarantined.discard(page_id)
        heapq.heappush(self.free, page_id)

    def _held(self, owner: bytes) -> list[int]:
        if (held := self.owners.get(owner)) is None:
            raise PageStateError(f"pool {self.pool_id}: owner {owner.hex()} is not open")
        return held

    def _expect(self, page_ids, what: str, ok) -> None:
        for page_id in page_ids:
            page = self.pages[page_id]
            if not ok(page):
                raise PageStateError(f"pool {self.pool_id}: page {page_id} must be {what}; it is {page.state.name} "
                                     f"at generation {page.generation}, owner "
                                     f"{page.owner.hex() if page.owner else None}, writer {page.active_writer}")


def _bad_claim(message: str) -> LeaseError:
    return LeaseError("FAILED_PRECONDITION", "BAD_CLAIM", message)


def check_owner(owner: bytes) -> None:
    if not isinstance(owner, bytes) or len(owner) != OWNER_NBYTES:
        got = len(owner) if isinstance(owner, bytes) else type(owner).__name__
        raise LeaseError("INVALID_ARGUMENT", "BAD_OWNER", f"owner must be {OWNER_NBYTES} bytes; got {got}")


CHAIN_NBYTES, SCOPE_TAG_NBYTES = 16, 8  # pdserve.common.prefix's KEY_NBYTES and SCOPE_TAG_NBYTES


def check_prefix_args(chains, scope_tag: bytes, what: str = "prefix_chains") -> None:
    """Refuses chain keys and a scope tag of the wrong size (a scope tag is required with any chain)."""
    bad = [i for i, chain in enumerate(chains) if not isinstance(chain, bytes) or len(chain) != CHAIN_NBYTES]
    if bad:
        first = chains[bad[0]]
        got = f"{len(first)} bytes" if isinstance(first, bytes) else type(first).__name__
        raise LeaseError("INVALID_ARGUMENT", "BAD_CHAIN", f"{what}[{bad[0]}] is {got}, not {CHAIN_NBYTES} bytes "
                                                          f"({len(bad)} of {len(chains)} chain keys are malformed)")
    if (chains or scope_tag) and len(scope_tag) != SCOPE_TAG_NBYTES:
        raise LeaseError("INVALID_ARGUMENT", "BAD_SCOPE_TAG",
                         f"scope_tag is {len(scope_tag)} bytes, not {SCOPE_TAG_NBYTES}, with {len(chains)} chain keys")
