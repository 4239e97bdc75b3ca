"""Page tags, checksums and the page-major KV pool (DESIGN §3)."""

import pytest
import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.kv_pool import KVPool, PoolLayout
from pdserve.engine.tags import (CHECKSUM, EPOCH, GENERATION, MAGIC, NUM_TOKENS, OWNER_HI, OWNER_LO, PAGE_INDEX,
                                  TAG_MAGIC, TAG_NBYTES, TAG_WORDS, expected_tags, make_tag, make_tags, owner_words,
                                  page_checksum)

M64 = (1 << 64) - 1
OWNER = bytes.fromhex("fedcba9876543210" "8000000000000001")  # both halves have the top bit set
EPOCH_HI = (1 << 63) + 0x1234_5678_9ABC  # >= 2**63: does not fit a signed int64 as is


def _owner_from_words(hi: int, lo: int) -> bytes:
    return (((hi & M64) << 64) | (lo & M64)).to_bytes(16, "big")


def _layout(dtype="float32"):
    return PoolLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=dtype)


def test_owner_words_round_trip():
    for owner in (OWNER, bytes(16), b"\xff" * 16, bytes(range(16))):
        hi, lo = owner_words(owner)
        assert -(1 << 63) <= hi < (1 << 63) and -(1 << 63) <= lo < (1 << 63)
        assert _owner_from_words(hi, lo) == owner
    assert owner_words(OWNER)[0] < 0  # stored as the signed int64 torch keeps


def test_owner_words_rejects_wrong_length():
    with pytest.raises(ValueError, match="15"):
        owner_words(b"x" * 15)


def test_make_tag_round_trip_through_int64_tensor():
    tag = torch.tensor(make_tag(OWNER, EPOCH_HI, 2**63 + 5, 7, 3, 0xDEADBEEF), dtype=torch.int64)
    assert tag.shape == (TAG_WORDS,)
    words = tag.tolist()
    assert _owner_from_words(words[OWNER_HI], words[OWNER_LO]) == OWNER
    assert words[EPOCH] & M64 == EPOCH_HI
    assert words[EPOCH] < 0
    assert words[GENERATION] & M64 == 2**63 + 5
    assert words[PAGE_INDEX] == 7
    assert words[NUM_TOKENS] == 3
    assert words[CHECKSUM] == 0xDEADBEEF
    assert words[MAGIC] & M64 == TAG_MAGIC
    assert TAG_NBYTES == tag.numel() * tag.element_size()


def test_make_tag_distinguishes_owners_and_epochs():
    other = OWNER[:15] + bytes([OWNER[15] ^ 1])
    assert make_tag(OWNER, 1, 1, 0, 4, 0) != make_tag(other, 1, 1, 0, 4, 0)
    assert make_tag(OWNER, EPOCH_HI, 1, 0, 4, 0) != make_tag(OWNER, EPOCH_HI ^ 1, 1, 0, 4, 0)


def test_expected_tags_shape_and_values():
    leases = [(9, 3), (2, 2**63 + 1), (5, 7)]
    want = expected_tags(OWNER, EPOCH_HI, leases)
    assert want.shape == (3, 5) and want.dtype == torch.int64
    hi, lo = owner_words(OWNER)
    for i, (_, gen) in enumerate(leases):
        row = want[i].tolist()
        assert row[:2] == [hi, lo]
        assert row[2] & M64 == EPOCH_HI
        assert row[3] & M64 == gen
        assert row[4] == i  # position in the request, not the physical page
    # the same words make_tag writes
    for i, (_, gen) in enumerate(leases):
        assert make_tag(OWNER, EPOCH_HI, gen, i, 4, 0)[:5] == want[i].tolist()


def test_expected_tags_empty():
    assert expected_tags(OWNER, 1, []).shape == (0, 5)


def _crc32c_reference(data: bytes) -> int:
    """Bitwise CRC-32C (reflected polynomial 0x82F63B78), the independent path the package is checked against."""
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_crc32c_reference_check_value():
    assert _crc32c_reference(b"123456789") == 0xE3069283  # the published CRC-32C check value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_checksum_is_crc32c_of_bytes(dtype):
    g = torch.Generator().manual_seed(0)
    page = torch.randn(2, 2, 4, 2, 8, generator=g).to(dtype)
    raw = page.view(torch.uint8).numpy().tobytes()
    assert len(raw) == page.numel() * page.element_size()
    assert page_checksum(page) == _crc32c_reference(raw)


def test_page_checksum_changes_on_one_flipped_byte():
    g = torch.Generator().manual_seed(1)
    page = torch.randn(2, 2, 4, 2, 8, generator=g)
    before = page_checksum(page)
    flat = page.view(torch.uint8).view(-1)
    for pos in (0, 123, flat.numel() - 1):
        flat[pos] ^= 0x10
        assert page_checksum(page) != before
        flat[pos] ^= 0x10
        assert page_checksum(page) == before


def test_pool_addresses():
    pool = KVPool(_layout(), 16)
    elem = 4
    assert pool.page_nbytes == 2 * 2 * 4 * 2 * 8 * elem == 1024
    assert pool.data_nbytes == 16 * 1024 == pool.kv.numel() * pool.kv.element_size()
    assert pool.tag_nbytes == 16 * TAG_NBYTES == pool.tags.numel() * 8
    assert pool.num_tokens == 64 and pool.page_size == 4
    for p in (0, 1, 7, 15):
        assert pool.page_addr(p) == pool.data_ptr + p * 1024 == pool.kv[p].data_ptr()
        assert pool.tag_addr(p) == pool.tag_ptr + p * TAG_NBYTES == pool.tags[p].data_ptr()


def test_one_page_is_one_contiguous_byte_range():
    pool = KVPool(_layout("bfloat16"), 4)
    assert pool.page_nbytes == 2 * 2 * 4 * 2 * 8 * 2
    page = pool.kv[2]
    assert page.is_contiguous()
    assert page.numel() * page.element_size() == pool.page_nbytes
    # every element of page 2 lies in [page_addr(2), page_addr(3))
    pool.kv[2].view(torch.uint8).fill_(0x5A)
    flat = pool.kv.view(torch.uint8).reshape(-1)
    start = pool.page_addr(2) - pool.data_ptr
    assert bool((flat[start:start + pool.page_nbytes] == 0x5A).all())
    assert int((flat == 0x5A).sum()) == pool.page_nbytes


def test_pool_checksum_matches_page_bytes():
    pool = KVPool(_layout(), 4)
    pool.fill([1], 0x33)
    assert pool.checksum(1) == _crc32c_reference(bytes([0x33]) * pool.page_nbytes)
    assert pool.checksum(0) == _crc32c_reference(bytes(pool.page_nbytes))


def test_pool_checksums_of_many_pages_match_one_by_one():
    pool = KVPool(_layout(), 6)
    pool.kv.uniform_(generator=torch.Generator().manual_seed(3))
    pages = [4, 0, 5, 2]
    got = pool.checksums(pages)
    assert got == [_crc32c_reference(pool.kv[p].view(torch.uint8).numpy().tobytes()) for p in pages]
    assert len(set(got)) == 4 and pool.checksums([]) == []


def test_fill_touches_only_named_pages():
    pool = KVPool(_layout(), 5)
    pool.fill([1, 3], 0xC7)
    for p in range(5):
        b = pool.kv[p].view(torch.uint8)
        assert bool((b == (0xC7 if p in (1, 3) else 0)).all())


@pytest.mark.parametrize("num_tokens", [0, 1, 3])
def test_zero_tail_zeroes_exactly_the_tail_slots(num_tokens):
    pool = KVPool(_layout(), 3)
    pool.fill([0, 1, 2], 0xAB)
    marker = pool.kv[0, 0, 0, 0, 0, 0].item()
    pool.zero_tail(1, num_tokens)
    page = pool.kv[1]  # [layers, 2, page_size, heads, dim]
    assert bool((page[:, :, num_tokens:] == 0).all())
    assert bool((page[:, :, :num_tokens] == marker).all())
    for p in (0, 2):
        assert bool((pool.kv[p] == marker).all())


def test_zero_tail_full_page_is_a_no_op():
    pool = KVPool(_layout(), 2)
    pool.fill([0, 1], 0xAB)
    before = pool.kv.clone()
    pool.zero_tail(1, 4)
    assert torch.equal(pool.kv.view(torch.uint8), before.view(torch.uint8))


def test_pool_needs_pages_and_layout_for_model():
    with pytest.raises(ValueError, match="0"):
        KVPool(_layout(), 0)
    cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)
    lay = PoolLayout.for_model(cfg, 16, "bfloat16")
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.page_size) == (4, 4, 32, 16)
    assert lay.page_nbytes == 4 * 2 * 16 * 4 * 32 * 2


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 64])
def test_make_tags_equals_make_tag_row_by_row(num_tokens):
    ps = 16
    n = -(-num_tokens // ps)
    gens = [3, (1 << 64) - 2, 7, 1 << 63][:n]
    sums = [0xDEADBEEF, 0, 1, 0xFFFFFFFF][:n]
    rows = [make_tag(OWNER, 0xFEDCBA9876543210, gens[i], i, min(ps, num_tokens - i * ps), sums[i]) for i in range(n)]
    got = make_tags(OWNER, 0xFEDCBA9876543210, gens, num_tokens, ps, sums)
    assert got.tolist() == rows
    assert int(got[:, NUM_TOKENS].sum()) == num_tokens
