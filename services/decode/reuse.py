"""Decode's side of prefix reuse (docs/design.md §8): the chain a request's pages must carry, computed here from
its own token ids, and the check of the cached pages the broker shares with it, before any of them is read.

A cached page is proof of nothing but what its tag and bytes say: decode reads one only when its tag carries this
request's chain key at this position, the lease's epoch and generation, a full page's token count, and its bytes
have the CRC-32C the broker recorded when the page was published (the tag's own checksum must agree). Anything
else is a miss: the page is reported (Unpublish) and the prompt's pages from it on are written by prefill.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..common.admission import check_tokens
from ..common.errors import invalid
from ..common.prefix import KEY_NBYTES, page_chains, scope_tag
from ..common.wire import prompt_digest
from ..engine.kv_pool import KVPool
from ..engine.tags import (CHAIN, CHECKSUM, EPOCH, GENERATION, MAGIC, NUM_TOKENS, OWNERSHIP, PAGE_INDEX, TAG_MAGIC,
                           _s64, chain_tensor)


@dataclass(slots=True, frozen=True)
class PrefixPlan:
    """A request's prefix scope and the chain keys of its full prompt pages."""
    scope: bytes
    tag: bytes  # the scope's fingerprint, kept by the broker with each cached page
    chains: list[bytes]  # one per full prompt page: what prefill must write into their tags
    lookup: list[bytes]  # the ones a Grant may share: the page of the last prompt token is always written

    @property
    def num_publishable(self) -> int:
        return len(self.chains)


def plan_prefix(scope: bytes, token_ids, num_prompt_tokens: int, digest: bytes, vocab_size: int,
                seed_of: Callable[[bytes], bytes], page_size: int, enabled: bool) -> PrefixPlan | None:
    """The plan of a Run with a prefix scope (None without one). Its token ids must be the prompt whose digest the
    write-done notice will carry: the chain decode checks is then over the tokens prefill computed."""
    if not scope:
        return None
    if len(scope) != KEY_NBYTES:
        raise invalid("BAD_PREFIX_SCOPE", f"prefix_scope must be {KEY_NBYTES} bytes or empty, got {len(scope)}")
    if len(token_ids) != num_prompt_tokens:
        raise invalid("BAD_PROMPT_IDS", f"a request with a prefix scope carries its {num_prompt_tokens} prompt token "
                                        f"ids; got {len(token_ids)}")
    check_tokens(token_ids, vocab_size)
    if prompt_digest(token_ids) != digest:
        raise invalid("BAD_PROMPT_IDS", f"the {len(token_ids)} prompt token ids do not hash to prompt_digest "
                                        f"{digest.hex()}")
    chains = page_chains(seed_of(scope), token_ids, page_size)
    lookup = chains[:(num_prompt_tokens - 1) // page_size] if enabled else []
    return PrefixPlan(scope, scope_tag(scope), chains, lookup)


def first_bad_shared(pool: KVPool, epoch: int, leases: list[tuple[int, int]], chains: list[bytes],
                     checksums: list[int], check_bytes: bool = True) -> tuple[int, str, str] | None:
    """(index, reason, message) of the first shared page (leases[i] holds prompt page i) that is not provably
    this request's chain, or None when all are. One vectorised pass over the tags, then the CRC-32C of the rest."""
    n = len(leases)
    if n == 0:
        return None
    pages = [p for p, _ in leases]
    tags = pool.tags[pages]
    checks = (
        ("TAG_MISSING", tags[:, MAGIC] == _s64(TAG_MAGIC)),
        ("TAG_EPOCH", tags[:, EPOCH] == _s64(epoch)),
        ("TAG_GENERATION", tags[:, GENERATION] == torch.tensor([_s64(g) for _, g in leases], dtype=torch.int64)),
        ("TAG_PAGE_INDEX", tags[:, PAGE_INDEX] == torch.arange(n)),
        ("TAG_NUM_TOKENS", tags[:, NUM_TOKENS] == pool.page_size),
        ("TAG_CHAIN", (tags[:, CHAIN] == chain_tensor(chains[:n])).all(dim=1)),
        ("CHECKSUM", tags[:, CHECKSUM] == torch.tensor(checksums, dtype=torch.int64)),
    )
    # (page, rank of the check, reason): at one page the first failing check in the order above names it
    bad = [(int((~ok).nonzero()[0, 0]), rank, reason) for rank, (reason, ok) in enumerate(checks) if not bool(ok.all())]
    if check_bytes:
        actual = pool.checksums(pages)
        if actual != list(checksums):
            bad.append((next(i for i in range(n) if actual[i] != checksums[i]), len(checks), "CHECKSUM"))
    if not bad:
        return None
    i, _, reason = min(bad)
    return i, reason, (f"cached prompt page {i} (physical page {pages[i]}, generation {leases[i][1]}) fails "
                       f"{reason}: it is not this request's KV; recomputed")


def shared_words(pool: KVPool, leases: list[tuple[int, int]]) -> torch.Tensor:
    """The ownership words the per-step check expects of checked shared pages: their tags as checked (the
    publisher's owner words, this epoch, the lease generation, the page index)."""
    return pool.tags[[p for p, _ in leases]][:, OWNERSHIP].clone().reshape(-1, OWNERSHIP.stop - OWNERSHIP.start)
