"""Page tags and checksums: the only proof of who wrote a KV page (pages are never zeroed).

A tag is TAG_WORDS int64 words per page, in a region separate from the page bytes:
owner_hi, owner_lo (the request's 128-bit key), epoch, generation, page_index, num_tokens,
checksum (CRC-32C of the page bytes as written), magic, chain_hi, chain_lo (the page's prefix chain key,
pdserve.common.prefix, on a full page written under a prefix scope; 0 otherwise).

CRC-32C (Castagnoli), not zlib's CRC-32: the `crc32c` package computes it with the CPU's CRC
instruction at ~20 GB/s, against ~3 GB/s for zlib, which made the checksum the largest guard
before the first token (2 ms of a 1,024-token prompt's KV on the tiny model, now 0.2 ms).
"""
from __future__ import annotations

import crc32c
import torch

from ..common.prefix import chain_words

TAG_WORDS = 10
TAG_NBYTES = TAG_WORDS * 8
TAG_MAGIC = 0x7064736572766532  # "pdserve2": the record with the chain words
OWNER_HI, OWNER_LO, EPOCH, GENERATION, PAGE_INDEX, NUM_TOKENS, CHECKSUM, MAGIC, CHAIN_HI, CHAIN_LO = range(TAG_WORDS)
CHAIN = slice(CHAIN_HI, CHAIN_LO + 1)
OWNERSHIP = slice(OWNER_HI, PAGE_INDEX + 1)  # the words a lease fixes; expected_tags gives them per page


def _s64(x: int) -> int:
    """An unsigned 64-bit value as the signed int64 torch stores."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= (1 << 63) else x


def owner_words(owner: bytes) -> tuple[int, int]:
    if len(owner) != 16:
        raise ValueError(f"owner key must be 16 bytes, got {len(owner)}")
    return _s64(int.from_bytes(owner[:8], "big")), _s64(int.from_bytes(owner[8:], "big"))


def make_tag(owner: bytes, epoch: int, generation: int, page_index: int, num_tokens: int,
             checksum: int) -> list[int]:
    hi, lo = owner_words(owner)
    return [hi, lo, _s64(epoch), _s64(generation), page_index, num_tokens, checksum, _s64(TAG_MAGIC), 0, 0]


def chain_tensor(chains: list[bytes]) -> torch.Tensor:
    """Chain keys as tag words: [len(chains), 2]."""
    return torch.tensor([chain_words(k) for k in chains], dtype=torch.int64).reshape(-1, 2)


def make_tags(owner: bytes, epoch: int, generations: list[int], num_tokens: int, page_size: int,
              checksums: list[int], first_index: int = 0, chains: list[bytes] = ()) -> torch.Tensor:
    """The tags of len(generations) pages of one request, from its page first_index on, holding num_tokens tokens:
    [n, TAG_WORDS], built column by column (make_tag row by row costs ~3 µs a page in Python). chains: the chain
    keys of the first len(chains) of these pages (full pages under a prefix scope); the others carry 0."""
    n = len(generations)
    if len(chains) > n:
        raise ValueError(f"{len(chains)} chain keys for {n} pages")
    hi, lo = owner_words(owner)
    t = torch.zeros((n, TAG_WORDS), dtype=torch.int64)
    t[:, OWNER_HI], t[:, OWNER_LO], t[:, EPOCH], t[:, MAGIC] = hi, lo, _s64(epoch), _s64(TAG_MAGIC)
    t[:, GENERATION] = torch.tensor([_s64(g) for g in generations], dtype=torch.int64)
    t[:, PAGE_INDEX] = torch.arange(first_index, first_index + n)
    t[:, NUM_TOKENS] = page_size
    if n:
        t[n - 1, NUM_TOKENS] = num_tokens - (n - 1) * page_size
    t[:, CHECKSUM] = torch.tensor(checksums, dtype=torch.int64)
    if len(chains):
        t[:len(chains), CHAIN] = chain_tensor(list(chains))
    return t


def expected_tags(owner: bytes, epoch: int, leases: list[tuple[int, int]]) -> torch.Tensor:
    """What the ownership words of each leased page's tag must be: [N, 5] (owner_hi..page_index)."""
    hi, lo = owner_words(owner)
    return torch.tensor([[hi, lo, _s64(epoch), _s64(gen), i] for i, (_, gen) in enumerate(leases)],
                        dtype=torch.int64).reshape(-1, OWNERSHIP.stop - OWNERSHIP.start)


def page_checksum(page: torch.Tensor) -> int:
    """CRC-32C of one page's bytes (the page is one contiguous range in the page-major pool)."""
    data = page.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    return crc32c.crc32c(data.contiguous().view(torch.uint8).numpy())


# crc32c drops the GIL for buffers of 32 KiB and more by default; taking it back behind a busy event loop
# costs up to a switch interval per page: 64 pages of 64 KiB took 15 ms instead of 0.3 ms with one other
# Python thread running. Pages under 1 MiB (~50 µs of CRC each) are summed holding the GIL.
_RELEASE_GIL_FROM = 1 << 20


def page_checksums(kv: torch.Tensor, pages: list[int]) -> list[int]:
    """CRC-32C of each listed page of a page-major pool, in order: one host view (or, on a GPU, one
    gather and copy) for all pages instead of a tensor per page."""
    if kv.device.type == "cpu":
        rows = kv.view(torch.uint8).reshape(kv.shape[0], -1).numpy()
    else:
        rows = kv[torch.tensor(pages, device=kv.device)].view(torch.uint8).reshape(len(pages), -1).cpu().numpy()
        pages = list(range(len(pages)))
    mode = 1 if rows.shape[1] >= _RELEASE_GIL_FROM else 0
    return [crc32c.crc32c(rows[p], gil_release_mode=mode) for p in pages]
