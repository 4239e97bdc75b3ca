"""Decode's fail-closed ownership checks (DESIGN §3 "Decode must"), against tags written the way prefill does."""
import pytest
import torch

from services.decode.verify import Violation, step_tag_mismatches, verify_prompt_pages
from services.engine.kv_pool import KVPool, PoolLayout
from services.engine.tags import (CHECKSUM, EPOCH, GENERATION, MAGIC, NUM_TOKENS, OWNER_HI, OWNER_LO, PAGE_INDEX,
                                  expected_tags, make_tag)

PS = 4
OWNER = bytes.fromhex("00112233445566778899aabbccddeeff")
OTHER = bytes.fromhex("ffeeddccbbaa99887766554433221100")
EPOCH_ = (1 << 63) + 99  # broker epochs are random 64-bit values: include the top bit
LEASES = [(5, 3), (9, 4), (2, 7), (12, 8)]  # (physical page, generation); the last is for decode's own tokens
NUM_PROMPT = 10  # 3 prompt pages: 4 + 4 + 2 tokens


def _pool():
    return KVPool(PoolLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=PS, dtype="float32"), 16)


def _write(pool, owner, epoch, leases, num_tokens, seed=0, index_of=lambda i: i, gen_of=None, count_of=None):
    """What PrefillWorker.write leaves in the destination: data (tail zeroed), then tags with checksums."""
    g = torch.Generator().manual_seed(seed)
    n = -(-num_tokens // PS)
    checksums = []
    for i, (page, gen) in enumerate(leases[:n]):
        pool.kv[page] = torch.randn(pool.kv[page].shape, generator=g)
        tokens = min(PS, num_tokens - i * PS)
        pool.zero_tail(page, tokens)
        c = pool.checksum(page)
        checksums.append(c)
        pool.tags[page] = torch.tensor(make_tag(owner, epoch, gen_of(i) if gen_of else gen, index_of(i),
                                                count_of(i) if count_of else tokens, c), dtype=torch.int64)
    return checksums


@pytest.fixture
def setup():
    pool = _pool()
    # pages are never zeroed: the pool starts full of another request's marker
    pool.fill(list(range(16)), 0x5C)
    checksums = _write(pool, OWNER, EPOCH_, LEASES, NUM_PROMPT)
    return pool, checksums


def _verify(pool, checksums, leases=LEASES, num_prompt=NUM_PROMPT, coverage=NUM_PROMPT, epoch=EPOCH_, owner=OWNER):
    verify_prompt_pages(pool, owner, epoch, leases, num_prompt, coverage, checksums)


def _violation(pool, checksums, **kw) -> Violation:
    with pytest.raises(Violation) as e:
        _verify(pool, checksums, **kw)
    assert str(e.value) == e.value.message
    return e.value


def test_correct_setup_passes(setup):
    pool, checksums = setup
    assert len(checksums) == 3
    _verify(pool, checksums)


@pytest.mark.parametrize("num_prompt", [1, 4, 8, 13, 16])
def test_correct_setup_passes_for_page_boundaries(num_prompt):
    pool = _pool()
    checksums = _write(pool, OWNER, EPOCH_, LEASES, num_prompt)
    assert len(checksums) == -(-num_prompt // PS)
    verify_prompt_pages(pool, OWNER, EPOCH_, LEASES, num_prompt, num_prompt, checksums)


def test_coverage_token_mismatch(setup):
    pool, checksums = setup
    v = _violation(pool, checksums, coverage=9)
    assert v.reason == "COVERAGE_MISMATCH"
    assert "9 tokens" in v.message and "10 tokens" in v.message


def test_coverage_page_count_mismatch(setup):
    pool, checksums = setup
    v = _violation(pool, checksums[:2])
    assert v.reason == "COVERAGE_MISMATCH"
    assert "2 pages" in v.message and "3 pages" in v.message


def test_too_few_leases(setup):
    pool, checksums = setup
    v = _violation(pool, checksums, leases=LEASES[:2])
    assert v.reason == "COVERAGE_MISMATCH"
    assert "only 2 leases" in v.message


def test_zero_tag_is_missing(setup):
    pool, checksums = setup
    pool.tags[LEASES[1][0]] = 0
    v = _violation(pool, checksums)
    assert v.reason == "TAG_MISSING"
    assert "prompt page 1" in v.message and "physical page 9" in v.message


def test_short_transfer_leaves_untagged_pages(setup):
    """The incident: only the first page arrived; the rest were never written in this pool."""
    pool = _pool()
    pool.fill(list(range(16)), 0x5C)
    checksums = _write(pool, OWNER, EPOCH_, LEASES, NUM_PROMPT)
    for page, _ in LEASES[1:3]:
        pool.tags[page] = 0
        pool.fill([page], 0x5C)
    assert _violation(pool, checksums).reason == "TAG_MISSING"


def test_another_owners_tag(setup):
    pool, checksums = setup
    page, gen = LEASES[2]
    pool.tags[page] = torch.tensor(make_tag(OTHER, EPOCH_, gen, 2, 2, checksums[2]))
    v = _violation(pool, checksums)
    assert v.reason == "TAG_OWNER"
    assert "prompt page 2" in v.message


@pytest.mark.parametrize("word", [OWNER_HI, OWNER_LO])
def test_either_owner_half_counts(setup, word):
    pool, checksums = setup
    pool.tags[LEASES[0][0], word] ^= 1
    assert _violation(pool, checksums).reason == "TAG_OWNER"


def test_wrong_epoch(setup):
    pool, checksums = setup
    _write(pool, OWNER, EPOCH_ - 1, LEASES, NUM_PROMPT)
    v = _violation(pool, checksums)
    assert v.reason == "TAG_EPOCH"
    assert f"{EPOCH_ - 1:#x}" in v.message and f"{EPOCH_:#x}" in v.message


def test_older_generation(setup):
    pool, checksums = setup
    checksums = _write(pool, OWNER, EPOCH_, LEASES, NUM_PROMPT, gen_of=lambda i: LEASES[i][1] - (i == 1))
    v = _violation(pool, checksums)
    assert v.reason == "TAG_GENERATION"
    assert "generation 3" in v.message and "lease generation 4" in v.message


def test_swapped_page_index(setup):
    pool, checksums = setup
    same_gen = [(p, 5) for p, _ in LEASES]
    checksums = _write(pool, OWNER, EPOCH_, same_gen, NUM_PROMPT, index_of=lambda i: {0: 1, 1: 0}.get(i, i),
                       count_of=lambda i: [4, 4, 2][i])
    v = _violation(pool, checksums, leases=same_gen)
    assert v.reason == "TAG_PAGE_INDEX"
    assert "prompt page 0" in v.message and "tagged as page 1" in v.message


def test_short_token_counts(setup):
    pool, checksums = setup
    checksums = _write(pool, OWNER, EPOCH_, LEASES, NUM_PROMPT, count_of=lambda i: [4, 3, 2][i])
    v = _violation(pool, checksums)
    assert v.reason == "TAG_NUM_TOKENS"
    assert "add up to 9" in v.message and "10 tokens" in v.message


def test_token_counts_that_sum_right_but_are_misplaced(setup):
    pool, checksums = setup
    checksums = _write(pool, OWNER, EPOCH_, LEASES, NUM_PROMPT, count_of=lambda i: [2, 4, 4][i])
    assert _violation(pool, checksums).reason == "TAG_NUM_TOKENS"


def test_flipped_byte_in_page_data(setup):
    pool, checksums = setup
    pool.kv[LEASES[1][0]].view(torch.uint8).view(-1)[123] ^= 0x10
    v = _violation(pool, checksums)
    assert v.reason == "CHECKSUM"
    assert "prompt page 1" in v.message and "physical page 9" in v.message
    assert f"{checksums[1]:#010x}" in v.message


def test_stale_bytes_in_tail_fail_checksum(setup):
    """Tail slots past the prompt were zeroed before the checksum; stale bytes there are caught."""
    pool, checksums = setup
    pool.kv[LEASES[2][0], 1, 1, 3] = 1.0  # last layer, V, slot 3 of the 2-token last page
    assert _violation(pool, checksums).reason == "CHECKSUM"


def test_prefill_reported_checksum_must_agree(setup):
    pool, checksums = setup
    bad = list(checksums)
    bad[0] ^= 1
    assert _violation(pool, bad).reason == "CHECKSUM"


def test_tag_checksum_must_agree(setup):
    pool, checksums = setup
    pool.tags[LEASES[2][0], CHECKSUM] ^= 1
    assert _violation(pool, checksums).reason == "CHECKSUM"


def test_unused_decode_lease_is_not_checked(setup):
    pool, checksums = setup
    pool.tags[LEASES[3][0]] = torch.tensor(make_tag(OTHER, 1, 1, 0, 4, 0))
    _verify(pool, checksums)


def test_without_byte_check_zero_checksums_pass_and_flips_go_unseen():
    """--no-transfer-checksum: prefill reports 0 per page; decode still checks every tag word but the bytes."""
    pool = _pool()
    _write(pool, OWNER, EPOCH_, LEASES, NUM_PROMPT)
    for page, _ in LEASES[:3]:
        pool.tags[page, CHECKSUM] = 0
    zeros = [0, 0, 0]
    with pytest.raises(Violation) as e:
        verify_prompt_pages(pool, OWNER, EPOCH_, LEASES, NUM_PROMPT, NUM_PROMPT, zeros)
    assert e.value.reason == "CHECKSUM"
    pool.kv[LEASES[0][0]].view(torch.uint8).view(-1)[5] ^= 1
    verify_prompt_pages(pool, OWNER, EPOCH_, LEASES, NUM_PROMPT, NUM_PROMPT, zeros, check_bytes=False)


@pytest.mark.parametrize("word,reason", [(MAGIC, "TAG_MISSING"), (OWNER_LO, "TAG_OWNER"), (EPOCH, "TAG_EPOCH"),
                                         (GENERATION, "TAG_GENERATION"), (PAGE_INDEX, "TAG_PAGE_INDEX"),
                                         (NUM_TOKENS, "TAG_NUM_TOKENS")])
def test_without_byte_check_tags_are_still_checked(setup, word, reason):
    pool, checksums = setup
    pool.tags[LEASES[1][0], word] += 1
    with pytest.raises(Violation) as e:
        verify_prompt_pages(pool, OWNER, EPOCH_, LEASES, NUM_PROMPT, NUM_PROMPT, checksums, check_bytes=False)
    assert e.value.reason == reason
    with pytest.raises(Violation) as e:
        verify_prompt_pages(pool, OWNER, EPOCH_, LEASES, NUM_PROMPT, NUM_PROMPT - 1, checksums, check_bytes=False)
    assert e.value.reason == "COVERAGE_MISMATCH"


def _batch():
    pool = _pool()
    seqs = [
        (bytes([1]) * 16, [(1, 10), (2, 11)]),
        (bytes([2]) * 16, [(3, 20), (4, 21), (5, 22)]),
        (bytes([3]) * 16, [(6, 30)]),
    ]
    for owner, leases in seqs:
        _write(pool, owner, EPOCH_, leases, PS * len(leases), seed=owner[0])
    pages = torch.tensor([p for _, leases in seqs for p, _ in leases], dtype=torch.int64)
    expected = torch.cat([expected_tags(owner, EPOCH_, leases) for owner, leases in seqs])
    lengths = [len(leases) for _, leases in seqs]
    return pool, pages, expected, lengths


def test_step_check_clean_batch():
    pool, pages, expected, lengths = _batch()
    assert expected.shape == (6, 5)
    assert step_tag_mismatches(pool.tags, pages, expected, lengths) == []


@pytest.mark.parametrize("tampered,word,want", [
    ([4], OWNER_HI, [1]),
    ([4], OWNER_LO, [1]),
    ([1], EPOCH, [0]),
    ([6], GENERATION, [2]),
    ([5], PAGE_INDEX, [1]),
    ([2, 6], GENERATION, [0, 2]),
    ([1, 3, 6], OWNER_LO, [0, 1, 2]),
])
def test_step_check_finds_exactly_the_tampered_sequences(tampered, word, want):
    pool, pages, expected, lengths = _batch()
    for p in tampered:
        pool.tags[p, word] += 1
    assert step_tag_mismatches(pool.tags, pages, expected, lengths) == want


def test_step_check_sees_a_foreign_tag_written_over_a_page():
    pool, pages, expected, lengths = _batch()
    pool.tags[3] = torch.tensor(make_tag(OTHER, EPOCH_, 20, 0, 4, 0))  # same gen/index, other owner
    assert step_tag_mismatches(pool.tags, pages, expected, lengths) == [1]


def test_step_check_only_reads_ownership_words():
    """Decode stamps its own pages with num_tokens=0, checksum=0; those words are not lease state."""
    pool, pages, expected, lengths = _batch()
    pool.tags[4, NUM_TOKENS] = 0
    pool.tags[4, CHECKSUM] = 0
    assert step_tag_mismatches(pool.tags, pages, expected, lengths) == []


def test_step_check_only_reads_listed_pages():
    pool, pages, expected, lengths = _batch()
    pool.tags[0] = 0
    pool.tags[15] = torch.tensor(make_tag(OTHER, 1, 1, 0, 4, 0))
    assert step_tag_mismatches(pool.tags, pages, expected, lengths) == []
    pool.tags[6, MAGIC] = 0
    pool.tags[6, EPOCH] = 0
    assert step_tag_mismatches(pool.tags, pages, expected, lengths) == [2]
