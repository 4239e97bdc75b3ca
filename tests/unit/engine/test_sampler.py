"""Sampler: greedy is arg-max, draws depend only on (seed, step), top-p keeps the smallest prefix."""
import collections
import math

import torch

from pdserve.engine.sampler import SamplingParams, sample, sample_one


def _logits(probs):
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        logits = torch.randn(512, generator=g)
        assert sample_one(logits, SamplingParams(temperature=0.0), step=0) == int(torch.argmax(logits))


def test_greedy_ignores_seed_and_step():
    logits = torch.zeros(16)
    logits[11] = 5.0
    draws = {sample_one(logits, SamplingParams(temperature=0.0, seed=s), step=t) for s in range(5) for t in range(5)}
    assert draws == {11}


def test_same_seed_and_step_gives_same_draw():
    logits = torch.zeros(512)  # uniform: every draw is pure randomness
    for seed in (0, 1, 12345, 2**62 + 7):
        for step in (0, 1, 50):
            p = SamplingParams(temperature=1.0, seed=seed)
            first = sample_one(logits, p, step)
            assert all(sample_one(logits, p, step) == first for _ in range(5))


def test_draw_depends_on_step_and_seed():
    logits = torch.zeros(512)
    by_step = [sample_one(logits, SamplingParams(temperature=1.0, seed=7), step) for step in range(100)]
    assert len(set(by_step)) > 50  # 100 uniform draws over 512 ids: nearly all distinct
    a = [sample_one(logits, SamplingParams(temperature=1.0, seed=1), s) for s in range(100)]
    b = [sample_one(logits, SamplingParams(temperature=1.0, seed=2), s) for s in range(100)]
    assert sum(x != y for x, y in zip(a, b)) > 90


def test_draws_follow_the_distribution():
    logits = _logits([0.5, 0.3, 0.2])
    counts = collections.Counter(sample_one(logits, SamplingParams(temperature=1.0, seed=s), 0)
                                 for s in range(2000))
    assert set(counts) == {0, 1, 2}
    assert abs(counts[0] / 2000 - 0.5) < 0.05
    assert abs(counts[1] / 2000 - 0.3) < 0.05
    assert abs(counts[2] / 2000 - 0.2) < 0.05


def test_top_p_keeps_smallest_prefix_reaching_top_p():
    # sorted order differs from id order, so the test also checks the scatter back to token ids
    logits = _logits([0.2, 0.5, 0.3])
    draws = [sample_one(logits, SamplingParams(temperature=1.0, top_p=0.6, seed=s), s % 3) for s in range(500)]
    counts = collections.Counter(draws)
    assert set(counts) == {1, 2}  # 0.5 < 0.6, so 0.3 joins; 0.2 never drawn
    assert counts[1] > counts[2]  # renormalised 5:3


def test_top_p_exactly_first_mass_keeps_one_token():
    logits = _logits([0.5, 0.3, 0.2])
    draws = {sample_one(logits, SamplingParams(temperature=1.0, top_p=0.5, seed=s), 0) for s in range(300)}
    assert draws == {0}


def test_top_p_tiny_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(512, generator=g)
    best = int(torch.argmax(logits))
    draws = {sample_one(logits, SamplingParams(temperature=1.0, top_p=1e-6, seed=s), s) for s in range(200)}
    assert draws == {best}


def test_top_p_one_can_draw_every_token():
    logits = _logits([0.4, 0.3, 0.2, 0.1])
    draws = {sample_one(logits, SamplingParams(temperature=1.0, top_p=1.0, seed=s), 0) for s in range(500)}
    assert draws == {0, 1, 2, 3}


def test_low_temperature_concentrates_on_argmax():
    logits = _logits([0.3, 0.4, 0.3])
    draws = {sample_one(logits, SamplingParams(temperature=0.01, seed=s), 0) for s in range(200)}
    assert draws == {1}


def test_sample_mixed_batch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 512, generator=g)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9, seed=9)]
    steps = [0, 3, 7, 2]
    out = sample(logits, params, steps)
    assert len(out) == 4 and all(isinstance(t, int) for t in out)
    assert out[0] == int(torch.argmax(logits[0]))
    assert out[2] == int(torch.argmax(logits[2]))
    assert out[1] == sample_one(logits[1], params[1], 3)
    assert out[3] == sample_one(logits[3], params[3], 2)
    # the row's own step is used, not its neighbour's
    other = [sample_one(logits[1], params[1], s) for s in range(20) if s != 3]
    assert any(t != out[1] for t in other)


def test_sample_row_is_independent_of_batch_composition():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 512, generator=g)
    p = SamplingParams(temperature=1.0, seed=42)
    alone = sample(logits[2:3], [p], [4])
    batched = sample(logits, [SamplingParams(), SamplingParams(temperature=1.0, seed=1), p], [0, 9, 4])
    assert batched[2] == alone[0]


def test_sample_all_greedy_and_empty():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 1.0, 1.0]])
    assert sample(logits, [SamplingParams(), SamplingParams()], [0, 0]) == [1, 0]
    assert sample(torch.zeros(0, 3), [], []) == []
