"""The per-step tag check as the scheduler runs it (StepExpectation): what the tags must say is kept between steps,
the tags themselves are read at every step, every page of every sequence. A write that lands on a page between
two steps, one that passed the step before with the very same batch, is found at the next step."""
import random

import numpy as np
import torch

from pdserve.decode.sequence import Sequence
from pdserve.decode.verify import StepExpectation, step_tag_mismatches
from pdserve.engine.sampler import SamplingParams
from pdserve.engine.tags import EPOCH, GENERATION, OWNER_HI, OWNER_LO, PAGE_INDEX, expected_tags, make_tag

from .tagged import EPOCH_, OTHER, PS, make_pool


def _seq(pool, owner: bytes, leases, num_prompt: int) -> Sequence:
    for i, (p, g) in enumerate(leases):
        pool.tags[p] = torch.tensor(make_tag(owner, EPOCH_, g, i, PS, 0))
    return Sequence(owner, EPOCH_, leases, expected_tags(owner, EPOCH_, leases), num_prompt, SamplingParams(),
                    frozenset([1]), [7])


def _batch(pool):
    return [_seq(pool, bytes([1]) * 16, [(1, 10), (2, 11), (3, 12)], 6),
            _seq(pool, bytes([2]) * 16, [(4, 20), (5, 21)], 3),
            _seq(pool, bytes([3]) * 16, [(6, 30), (7, 31), (8, 32)], 9)]


def _lengths(batch):
    return [s.position // PS + 1 for s in batch]


def test_a_tag_rewritten_after_a_clean_step_is_found_at_the_next():
    pool = make_pool()
    batch = _batch(pool)
    check = StepExpectation()
    for _ in range(3):  # the same batch, the same pages: the expectation is kept
        assert check.mismatches(pool.tags.numpy(), batch, _lengths(batch)) == []
    for page, word, want in ((2, OWNER_LO, [0]), (4, EPOCH, [1]), (7, GENERATION, [2]), (6, PAGE_INDEX, [2])):
        saved = pool.tags[page].clone()
        pool.tags[page, word] ^= 1
        assert check.mismatches(pool.tags.numpy(), batch, _lengths(batch)) == want
        pool.tags[page] = saved
        assert check.mismatches(pool.tags.numpy(), batch, _lengths(batch)) == []


def test_a_foreign_tag_over_every_page_read_is_found_and_no_other():
    pool = make_pool()
    batch = _batch(pool)
    check = StepExpectation()
    assert check.mismatches(pool.tags.numpy(), batch, [3, 2, 3]) == []
    pool.tags[5] = torch.tensor(make_tag(OTHER, EPOCH_, 21, 1, PS, 0))
    assert check.mismatches(pool.tags.numpy(), batch, [3, 2, 3]) == [1]
    assert check.mismatches(pool.tags.numpy(), batch, [3, 1, 3]) == []  # page 5 is not read at this step


def test_the_page_a_sequence_reads_next_is_checked_from_the_step_that_reads_it():
    pool = make_pool()
    batch = _batch(pool)
    check = StepExpectation()
    pool.tags[3, OWNER_HI] = 0  # the third page of the first sequence: not read yet
    assert check.mismatches(pool.tags.numpy(), batch, [2, 2, 3]) == []
    assert check.mismatches(pool.tags.numpy(), batch, [3, 2, 3]) == [0]


def test_grown_leases_are_expected_at_their_page_indices():
    pool = make_pool()
    batch = _batch(pool)
    check = StepExpectation()
    assert check.mismatches(pool.tags.numpy(), batch, [3, 2, 3]) == []
    owner = batch[1].owner
    batch[1].grow([(9, 22)])
    pool.tags[9] = torch.tensor(make_tag(owner, EPOCH_, 22, 2, 0, 0))
    assert check.mismatches(pool.tags.numpy(), batch, [3, 3, 3]) == []
    pool.tags[9, PAGE_INDEX] = 0  # the grown page tagged as the request's first page
    assert check.mismatches(pool.tags.numpy(), batch, [3, 3, 3]) == [1]


def test_another_request_in_the_same_place_of_the_batch_is_checked_against_its_own_leases():
    """Same batch position, same pages, same lengths, a new request (the page was re-granted): the tags still
    carry the old owner's words, which are no proof for the new one."""
    pool = make_pool()
    batch = _batch(pool)
    check = StepExpectation()
    assert check.mismatches(pool.tags.numpy(), batch, [3, 2, 3]) == []
    old = batch[1]
    new = Sequence(bytes([9]) * 16, EPOCH_, old.leases, expected_tags(bytes([9]) * 16, EPOCH_, old.leases), 3,
                   SamplingParams(), frozenset([1]), [7])
    old.done = True
    batch = [batch[0], new, batch[2]]
    assert check.mismatches(pool.tags.numpy(), batch, [3, 2, 3]) == [1]


def test_agrees_with_the_torch_check_over_random_batches_and_corruptions():
    rng = random.Random(5)
    pool = make_pool()
    check = StepExpectation()
    seqs = _batch(pool)
    for _ in range(300):
        batch = rng.sample(seqs, rng.randint(1, 3))
        lengths = [rng.randint(1, len(s.pages)) for s in batch]
        saved = pool.tags.clone()
        for _ in range(rng.randint(0, 2)):
            pool.tags[rng.randint(1, 8), rng.randint(0, 4)] ^= 1 << rng.randint(0, 63)
        pages = torch.cat([s.page_ids[:n] for s, n in zip(batch, lengths)])
        expected = torch.cat([s.expected[:n] for s, n in zip(batch, lengths)])
        want = step_tag_mismatches(pool.tags, pages, expected, lengths)
        assert check.mismatches(pool.tags.numpy(), batch, lengths) == want
        pool.tags.copy_(saved)
    assert np.array_equal(pool.tags.numpy(), saved.numpy())
