"""Page and pool state of the broker's lease table, and the error its operations raise: data only, the
transitions live in LeaseTable.

A CACHED page (prefix reuse) has no owner: it is leased read-only to a set of readers (owners whose lease lists
hold it), is never written again, and is found by its chain key in the pool's PrefixCache."""

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
__all__ = ["CHAIN_NBYTES", "OWNER_NBYTES", "SCOPE_TAG_NBYTES", "Lease", "LeaseError", "Page", "PageState", "PoolPages",
           "Revocation"]


class LeaseError(Exception):
    """A refused operation. kind: INVALID_ARGUMENT, RESOURCE_EXHAUSTED, FAILED_PRECONDITION, NOT_FOUND or
    ALREADY_EXISTS (the gRPC status code it maps to); reason: machine-readable, UPPER_SNAKE."""

    def __init__(self, kind: str, reason: str, message: str):
        super().__init__(message)
        self.kind, self.reason, self.message = kind, reason, message


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
    owners: dict[bytes, list[int]] = field(default_factory=dict)
    quarantined: set[int] = field(default_factory=set)
    writing: set[int] = field(default_factory=set)
    next_generation: int = 1  # 0 is proto3's "unset" and never names a lease
    revocations: RevocationLog = field(default_factory=RevocationLog)
    granted_at: dict[bytes, float] = field(default_factory=dict)  # owner -> clock at its grant
    reader_expiry: float = float("inf")  # the pool's decode renews it; set at registration
    region: object = None  # where decode registered the pool's bytes (opaque here; a PoolRegion message)
    # revoked owners whose pages wait for the reader's acknowledgement: owner -> (quarantine holder, revocation seq)
    unacked: dict[bytes, tuple[str, int]] = field(default_factory=dict)
    cache: PrefixCache = field(default_factory=PrefixCache)
    released: OrderedDict = field(default_factory=OrderedDict)  # owner -> None, oldest first (RELEASED_MEMORY)

    def __post_init__(self) -> None:
        self.pages = [Page() for _ in range(self.num_pages)]
        self.free = list(range(self.num_pages))  # sorted, hence already a valid heap

    def note_released(self, owner: bytes) -> None:
        self.released[owner] = None
        self.released.move_to_end(owner)
        if len(self.released) > RELEASED_MEMORY:
            self.released.popitem(last=False)

    def free_page(self, page_id: int) -> None:
        page = self.pages[page_id]
        page.state, page.owner = PageState.FREE, None
        page.readers, page.pins, page.chain, page.checksum, page.scope_tag = frozenset(), frozenset(), b"", 0, b""
        self.quarantined.discard(page_id)
        heapq.heappush(self.free, page_id)

    def hold(self, page_ids: list[int], writer: str) -> None:
        """Quarantines pages a writer of an earlier epoch may still reach (the broker restarted)."""
        for page_id in page_ids:
            page = self.pages[page_id]
            page.state, page.active_writer = PageState.QUARANTINED, (writer, 0)
            self.quarantined.add(page_id)
            self.writing.add(page_id)
        self.free = [i for i in self.free if i not in self.quarantined]
        heapq.heapify(self.free)

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
