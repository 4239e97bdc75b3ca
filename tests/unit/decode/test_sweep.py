"""Checksum sweep (sweep.py): a data-only change to a prompt page is found within ceil(P / budget) sweeps,
only its own sequence is named, and decode's own writes after the prompt in the last page never are."""
import math

import numpy as np
import pytest
import torch

from pdserve.decode.sweep import CHECKED, ChecksumSweep, PromptRecord, prompt_checksums
from pdserve.engine.tags import page_checksums

from .tagged import EPOCH_, PS, make_pool, write_pages

# (owner byte, leases, prompt tokens): prompts of 10, 8 and 13 tokens, 3 + 2 + 4 = 9 prompt pages
SEQS = [(1, [(0, 1), (1, 1), (2, 1), (3, 1)], 10),
        (2, [(4, 2), (5, 2), (6, 2)], 8),
        (3, [(7, 3), (8, 3), (9, 3), (10, 3), (11, 3)], 13)]
NUM_PAGES = sum(-(-n // PS) for _, _, n in SEQS)


def _batch():
    pool = make_pool()
    records = []
    for owner, leases, n in SEQS:
        checksums = write_pages(pool, bytes([owner]) * 16, EPOCH_, leases, n, seed=owner)
        records.append(PromptRecord.of(leases, n, PS, checksums))
    return pool, records


def _decode_writes(pool, step: int) -> None:
    """What decode's own steps leave: each sequence's next KV slot after its prompt (and onwards) is written."""
    for owner, leases, n in SEQS:
        pos = n + step % (len(leases) * PS - n)  # wraps over the slots after the prompt
        page = leases[pos // PS][0]
        pool.kv[page, :, :, pos % PS] = float(owner + step)


def test_masked_checksum_equals_prefills_after_decode_writes_the_tail():
    pool, records = _batch()
    owner, leases, n = SEQS[0]
    last = leases[n // PS][0]
    before = prompt_checksums(pool, [last], [n % PS])
    assert before == page_checksums(pool.kv, [last])  # the tail was zeroed, as prefill leaves it
    pool.kv[last, :, :, n % PS] = 3.0  # decode's first own token lands after the prompt, in the same page
    assert page_checksums(pool.kv, [last]) != before  # a whole-page checksum would be a false DATA_LOSS
    assert prompt_checksums(pool, [last], [n % PS]) == before
    pool.kv[last, 1, 0, n % PS - 1, 0, 0] += 1.0  # a prompt slot of the same page: seen
    assert prompt_checksums(pool, [last], [n % PS]) != before


def test_no_false_positive_over_many_cycles_while_decode_writes():
    pool, records = _batch()
    sweep = ChecksumSweep(pool, 2)
    for r in records:
        sweep.admit(r)
    for step in range(3 * PS):
        _decode_writes(pool, step)
        assert sweep(records) == []


@pytest.mark.parametrize("budget,every", [(1, 1), (2, 1), (3, 1), (8, 1), (100, 1), (2, 3), (8, 4)])
@pytest.mark.parametrize("victim,page", [(0, 0), (0, 2), (1, 1), (2, 3), (2, 0)])
def test_data_only_change_is_found_within_the_bound(budget, every, victim, page):
    pool, records = _batch()
    sweep = ChecksumSweep(pool, budget, every)
    for r in records:
        sweep.admit(r)
    bound = every * math.ceil(NUM_PAGES / budget)
    # some rotation first, so the corrupted page is not simply first in line
    for step in range(bound + 1):
        _decode_writes(pool, step)
        assert sweep(records) == []
    owner, leases, n = SEQS[victim]
    phys = leases[page][0]
    tag_before = pool.tags[phys].clone()
    pool.kv[phys, 0, 1, 0, 0, 0] += 0.25  # data alone: the tag stays as it was
    found = []
    for k in range(1, bound + 1):
        _decode_writes(pool, bound + k)
        found = sweep(records)
        if found:
            break
    assert [(m.index, m.page_index, m.page) for m in found] == [(victim, page, phys)], (budget, every, k)
    assert sweep.step % every == 0  # only the steps the sweep runs before find anything
    assert found[0].expected == int(records[victim].table[page, 2]) != found[0].actual
    assert torch.equal(pool.tags[phys], tag_before)


def test_every_page_is_checked_within_the_bound_as_requests_join():
    pool, records = _batch()
    sweep = ChecksumSweep(pool, 2)
    sweep.admit(records[0])
    batch = [records[0]]
    for step in range(1, 40):
        if step == 3:
            sweep.admit(records[1])
            batch.append(records[1])
        if step == 7:
            sweep.admit(records[2])
            batch.append(records[2])
        sweep(batch)
        pages = sum(len(r.table) for r in batch)
        ages = np.concatenate([r.table[:, CHECKED] for r in batch])
        assert int(ages.min()) > sweep.step - math.ceil(pages / 2), (step, ages.tolist())


def test_budget_zero_checks_nothing():
    pool, records = _batch()
    sweep = ChecksumSweep(pool, 0)
    pool.kv[SEQS[0][1][0][0]] += 1.0
    assert sweep(records) == []
    with pytest.raises(ValueError, match="-1"):
        ChecksumSweep(pool, -1)


def test_sequences_without_a_record_are_skipped():
    pool, records = _batch()
    sweep = ChecksumSweep(pool, 100)
    phys = SEQS[2][1][1][0]
    pool.kv[phys, 0, 0, 0] += 1.0
    assert [m.index for m in sweep([None, records[0], records[2]])] == [2]
