"""Ownership checks decode runs before it reads a KV page (DESIGN §3, fail closed).

Pages are never zeroed between requests, so the tag is the only proof of who wrote a page. Every
function here raises Violation; callers end the request with DATA_LOSS and emit nothing from it.
"""
from __future__ import annotations

import numpy as np
import torch

from ..common.config import pages_for
from ..common.metrics import CANARY_HITS
from ..engine.kv_pool import KVPool
from ..engine.tags import (CHAIN, CHECKSUM, EPOCH, GENERATION, MAGIC, NUM_TOKENS, OWNER_HI, OWNER_LO, OWNERSHIP,
                           PAGE_INDEX, TAG_MAGIC, TAG_WORDS, _s64, chain_tensor, expected_tags)


class Violation(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def verify_prompt_pages(pool: KVPool, owner: bytes, epoch: int, leases: list[tuple[int, int]],
                        num_prompt_tokens: int, coverage_tokens: int, coverage_checksums: list[int],
                        check_bytes: bool = True, first: int = 0, chains: list[bytes] | None = None) -> None:
    """After prefill reports done: every prompt page it wrote (those from `first` on: the ones before are cached
    pages, checked when they were shared) must carry this lease's tag, token counts must add up to the prompt (a
    short transfer leaves stale tags behind) and the bytes must match the checksum. chains (with a prefix scope):
    each full page's tag must carry its chain key, as decode computed it from the prompt's own token ids."""
    ps = pool.page_size
    n = pages_for(num_prompt_tokens, ps)
    written = num_prompt_tokens - first * ps
    if coverage_tokens != written or len(coverage_checksums) != n - first:
        raise Violation("COVERAGE_MISMATCH", f"prefill reports {coverage_tokens} tokens in "
                                             f"{len(coverage_checksums)} pages; the prompt is {num_prompt_tokens} "
                                             f"tokens in {n} pages, {first} of them cached")
    if len(leases) < n:
        raise Violation("COVERAGE_MISMATCH", f"{n} prompt pages but only {len(leases)} leases")
    pages = [p for p, _ in leases[first:n]]
    tags = pool.tags[pages]  # [n - first, TAG_WORDS]
    want = expected_tags(owner, epoch, leases[:n])[first:]
    # one vectorised comparison; the per-page walk below only runs to name the first bad page
    ok = (tags[:, MAGIC] == _s64(TAG_MAGIC)) & (tags[:, OWNERSHIP] == want).all(dim=1)
    if not bool(ok.all()):
        i = int((~ok).nonzero()[0, 0])
        _raise_tag_violation(tags[i], want[i], first + i, pages[i], epoch, leases[first + i][1])
    counts = tags[:, NUM_TOKENS].tolist()
    expect = [min(ps, num_prompt_tokens - i * ps) for i in range(first, n)]
    if counts != expect:
        raise Violation("TAG_NUM_TOKENS", f"page token counts add up to {sum(counts)}, the {n - first} written "
                                          f"pages hold {written} tokens (pages {counts[:8]}...)")
    if chains is not None:
        full = min(len(chains), n) - first
        if full > 0:
            ok = (tags[:full, CHAIN] == chain_tensor(chains[first:first + full])).all(dim=1)
            if not bool(ok.all()):
                i = int((~ok).nonzero()[0, 0])
                raise Violation("TAG_CHAIN", f"prompt page {first + i} (physical page {pages[i]}) carries another "
                                             f"prefix chain than this prompt's own tokens give")
    if not check_bytes:
        return
    actual = pool.checksums(pages)
    tagged = tags[:, CHECKSUM].tolist()
    if actual != tagged or actual != coverage_checksums:
        i = next(i for i in range(len(pages)) if actual[i] != tagged[i] or actual[i] != coverage_checksums[i])
        raise Violation("CHECKSUM", f"prompt page {first + i} (physical page {pages[i]}): bytes have CRC-32C "
                                    f"{actual[i]:#010x}, tag says {tagged[i]:#010x}, prefill reported "
                                    f"{coverage_checksums[i]:#010x}")


def _raise_tag_violation(t: torch.Tensor, want: torch.Tensor, i: int, page: int, epoch: int, generation: int):
    where = f"prompt page {i} (physical page {page})"
    if int(t[MAGIC]) != _s64(TAG_MAGIC):
        raise Violation("TAG_MISSING", f"{where} has no tag: nothing was written to it")
    if int(t[OWNER_HI]) != int(want[0]) or int(t[OWNER_LO]) != int(want[1]):
        raise Violation("TAG_OWNER", f"{where} is tagged for another request")
    if int(t[EPOCH]) != int(want[2]):
        raise Violation("TAG_EPOCH", f"{where} carries epoch {int(t[EPOCH]) & (2**64 - 1):#x}, "
                                     f"lease epoch {epoch:#x}")
    if int(t[GENERATION]) != int(want[3]):
        raise Violation("TAG_GENERATION", f"{where} carries generation {int(t[GENERATION])}, "
                                          f"lease generation {generation}")
    raise Violation("TAG_PAGE_INDEX", f"{where} is tagged as page {int(t[PAGE_INDEX])}")


CANARY_BYTE = 0x7F  # 0x7F7F7F7F as float32 is 3.4e38: attention over it would wreck the logits


def check_canaries(pool: KVPool, leases: list[tuple[int, int]], num_prompt_tokens: int) -> None:
    """Canary mode (tests): released pages were filled with CANARY_BYTE; a verified prompt page must
    hold none of it, or stale bytes passed every check."""
    marker = int.from_bytes(bytes([CANARY_BYTE]) * 4, "little")
    for i, (p, _) in enumerate(leases[: pages_for(num_prompt_tokens, pool.page_size)]):
        if bool((pool.kv[p].view(torch.int32) == marker).any()):
            CANARY_HITS.inc()
            raise Violation("CANARY", f"verified prompt page {i} (physical page {p}) carries a freed page's marker")


def step_tag_mismatches(tags: torch.Tensor, pages: torch.Tensor, expected: torch.Tensor,
                        lengths: list[int]) -> list[int]:
    """Per-step check, vectorised over the batch: the ownership words (owner, epoch, generation,
    page index) of every page the step reads must equal the leases. Returns the indices of sequences
    with a mismatch. pages: [N] concatenated page ids; expected: [N, 5]; lengths: pages per sequence."""
    ok = (tags[pages, OWNERSHIP] == expected).all(dim=1)
    if bool(ok.all()):
        return []
    return [i for i, seg in enumerate(torch.split(ok, lengths)) if not bool(seg.all())]


class StepExpectation:
    """step_tag_mismatches over numpy, with what the tags must say kept from one step to the next.

    What the batch's tags must say (its pages and their ownership words) is fixed by its sequences' leases and
    changes only when the batch does: a sequence joins or leaves, reads one more page, or grows its leases. So it
    is gathered again only then; the tags themselves are read from the pool, every page of every sequence, at
    every call, because what may rewrite a tag between two steps is exactly what this check is for: a one-sided
    Mooncake write (a stale or rogue writer) that decode is never told about, landing on any page at any time.
    A cache of "pages known good" would skip the very page such a write hit."""

    def __init__(self) -> None:
        self._key: list[tuple] = []
        self._views: dict[int, tuple] = {}            # id(sequence) -> (it, its tensors, their numpy views)
        self._pages = np.zeros(0, dtype=np.int64)     # [N] physical pages the step reads, batch order
        self._expected = np.zeros((0, OWNERSHIP.stop - OWNERSHIP.start), dtype=np.int64)  # [N, 5]
        self._seq_of = np.zeros(0, dtype=np.int64)    # [N] batch position of each row
        self._flat = np.zeros(0, dtype=np.int64)      # [N * 5] positions of those words in the flat tag region
        self._expected_bytes = b""

    def _is_current(self, batch: list, lengths: list[int]) -> bool:
        # identity, not equality: the key holds the sequences and their tensors, so none of them can be freed and
        # another allocated in its place; a lease change (grow) gives a sequence new tensors
        key = self._key
        if len(key) != len(batch):
            return False
        for (s0, p0, e0, n0), s, n in zip(key, batch, lengths):
            if s0 is not s or p0 is not s.page_ids or e0 is not s.expected or n0 != n:
                return False
        return True

    def _gather(self, batch: list, lengths: list[int]) -> None:
        views = {k: v for k, v in self._views.items() if not v[0].done}
        rows = []
        for s in batch:
            v = views.get(id(s))
            if v is None or v[0] is not s or v[1] is not s.page_ids or v[2] is not s.expected:
                v = views[id(s)] = (s, s.page_ids, s.expected, s.page_ids.numpy(), s.expected.numpy())
            rows.append(v)
        self._views = views
        self._key = [(s, p, e, n) for (s, p, e, _, _), n in zip(rows, lengths)]
        self._pages = np.concatenate([v[3][:n] for v, n in zip(rows, lengths)])
        self._expected = np.concatenate([v[4][:n] for v, n in zip(rows, lengths)])
        self._seq_of = np.repeat(np.arange(len(batch)), lengths)
        # one take and one memcmp a step: numpy's 2-D index and array_equal cost ~3x as much
        self._flat = (self._pages[:, None] * TAG_WORDS + np.arange(OWNERSHIP.start, OWNERSHIP.stop)).reshape(-1)
        self._expected_bytes = self._expected.tobytes()

    def mismatches(self, tags: np.ndarray, batch: list, lengths: list[int]) -> list[int]:
        """Indices into batch of the sequences whose first lengths[i] pages' ownership words differ from their
        leases'. tags: the pool's [num_pages, TAG_WORDS] int64 tags, a view (read now, not copied before)."""
        if not self._is_current(batch, lengths):
            self._gather(batch, lengths)
        read = tags.reshape(-1).take(self._flat)  # a copy of the words as they are now
        if read.tobytes() == self._expected_bytes:
            return []
        ok = (read.reshape(self._expected.shape) == self._expected).all(axis=1)
        return np.unique(self._seq_of[~ok]).tolist()


__all__ = ["CANARY_BYTE", "StepExpectation", "Violation", "check_canaries", "verify_prompt_pages",
           "step_tag_mismatches"]
