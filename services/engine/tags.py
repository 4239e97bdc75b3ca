"""Page tags and checksums: the only proof of who wrote a KV page (pages are never zeroed).

A tag is TAG_WORDS int64 words per page, in a region separate from the page bytes:
owner_hi, owner_lo (the request's 128-bit key), epoch, generation, page_index, num_tokens,
checksum (CRC32 of the page bytes as written), magic.
"""
from __future__ import annotations

import zlib

import torch

TAG_WORDS = 8
TAG_NBYTES = TAG_WORDS * 8
TAG_MAGIC = 0x7064736572766531  # "pdserve1"
OWNER_HI, OWNER_LO, EPOCH, GENERATION, PAGE_INDEX, NUM_TOKENS, CHECKSUM, MAGIC = range(TAG_WORDS)


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
    return [hi, lo, _s64(epoch), _s64(generation), page_index, num_tokens, checksum, _s64(TAG_MAGIC)]


def expected_tags(owner: bytes, epoch: int, leases: list[tuple[int, int]]) -> torch.Tensor:
    """What the ownership words of each leased page's tag must be: [N, 5] (owner_hi..page_index)."""
    hi, lo = owner_words(owner)
    return torch.tensor([[hi, lo, _s64(epoch), _s64(gen), i] for i, (_, gen) in enumerate(leases)],
                        dtype=torch.int64).reshape(-1, 5)


def page_checksum(page: torch.Tensor) -> int:
    """CRC32 of one page's bytes (the page is one contiguous range in the page-major pool)."""
    data = page.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    return zlib.crc32(data.contiguous().view(torch.uint8).numpy()) & 0xFFFFFFFF
