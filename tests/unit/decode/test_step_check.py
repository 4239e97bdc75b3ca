"""Decode's per-step check (DESIGN §3 "Decode must" 3): before every step, the ownership words of every
page the batch reads must equal the leases, vectorised over the batch; a mismatch names its sequences."""
import pytest
import torch

from pdserve.decode.verify import step_tag_mismatches
from pdserve.engine.tags import CHECKSUM, EPOCH, GENERATION, MAGIC, NUM_TOKENS, OWNER_HI, OWNER_LO, PAGE_INDEX, \
    expected_tags, make_tag

from .tagged import EPOCH_, OTHER, PS, make_pool, write_pages


def _batch():
    pool = make_pool()
    seqs = [
        (bytes([1]) * 16, [(1, 10), (2, 11)]),
        (bytes([2]) * 16, [(3, 20), (4, 21), (5, 22)]),
        (bytes([3]) * 16, [(6, 30)]),
    ]
    for owner, leases in seqs:
        write_pages(pool, owner, EPOCH_, leases, PS * len(leases), seed=owner[0])
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
