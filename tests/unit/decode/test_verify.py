"""Decode's fail-closed ownership checks (DESIGN §3 "Decode must"), against tags written the way prefill does."""
import pytest
import torch

from pdserve.decode.verify import Violation, verify_prompt_pages
from pdserve.engine.tags import (CHECKSUM, EPOCH, GENERATION, MAGIC, NUM_TOKENS, OWNER_HI, OWNER_LO, PAGE_INDEX,
                                  make_tag)

from .tagged import EPOCH_, LEASES, NUM_PROMPT, OTHER, OWNER, PS, make_pool, write_pages


@pytest.fixture
def setup():
    pool = make_pool()
    # pages are never zeroed: the pool starts full of another request's marker
    pool.fill(list(range(16)), 0x5C)
    checksums = write_pages(pool, OWNER, EPOCH_, LEASES, NUM_PROMPT)
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
    pool = make_pool()
    checksums = write_pages(pool, OWNER, EPOCH_, LEASES, num_prompt)
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
    pool = make_pool()
    pool.fill(list(range(16)), 0x5C)
    checksums = write_pages(pool, OWNER, EPOCH_, LEASES, NUM_PROMPT)
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
    write_pages(pool, OWNER, EPOCH_ - 1, LEASES, NUM_PROMPT)
    v = _violation(pool, checksums)
    assert v.reason == "TAG_EPOCH"
    assert f"{EPOCH_ - 1:#x}" in v.message and f"{EPOCH_:#x}" in v.message


def test_older_generation(setup):
    pool, checksums = setup
    checksums = write_pages(pool, OWNER, EPOCH_, LEASES, NUM_PROMPT, gen_of=lambda i: LEASES[i][1] - (i == 1))
    v = _violation(pool, checksums)
    assert v.reason == "TAG_GENERATION"
    assert "generation 3" in v.message and "lease generation 4" in v.message


def test_swapped_page_index(setup):
    pool, checksums = setup
    same_gen = [(p, 5) for p, _ in LEASES]
    checksums = write_pages(pool, OWNER, EPOCH_, same_gen, NUM_PROMPT, index_of=lambda i: {0: 1, 1: 0}.get(i, i),
                       count_of=lambda i: [4, 4, 2][i])
    v = _violation(pool, checksums, leases=same_gen)
    assert v.reason == "TAG_PAGE_INDEX"
    assert "prompt page 0" in v.message and "tagged as page 1" in v.message


def test_short_token_counts(setup):
    pool, checksums = setup
    checksums = write_pages(pool, OWNER, EPOCH_, LEASES, NUM_PROMPT, count_of=lambda i: [4, 3, 2][i])
    v = _violation(pool, checksums)
    assert v.reason == "TAG_NUM_TOKENS"
    assert "add up to 9" in v.message and "10 tokens" in v.message


def test_token_counts_that_sum_right_but_are_misplaced(setup):
    pool, checksums = setup
    checksums = write_pages(pool, OWNER, EPOCH_, LEASES, NUM_PROMPT, count_of=lambda i: [2, 4, 4][i])
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
    pool = make_pool()
    write_pages(pool, OWNER, EPOCH_, LEASES, NUM_PROMPT)
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
