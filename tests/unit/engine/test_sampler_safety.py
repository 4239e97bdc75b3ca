"""Sampling is numerically safe over every admitted value (temperature finite >= 0, top_p in (0, 1]): no NaN
probabilities, a token inside the vocabulary, a temperature under GREEDY_BELOW is the arg-max, and a row whose
sampling cannot succeed (non-finite logits) fails alone, in its own place of the batch."""
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.common.admission import check_sampling
from pdserve.engine.sampler import GREEDY_BELOW, SamplingError, SamplingParams, _probs, sample, sample_one

# every admitted temperature, weighted towards the edges: 0, subnormal, around the greedy cut-off, huge
TEMPERATURES = st.one_of(
    st.just(0.0), st.just(5e-38), st.just(GREEDY_BELOW),
    st.floats(min_value=0.0, max_value=GREEDY_BELOW, allow_subnormal=True),
    st.floats(min_value=GREEDY_BELOW, max_value=10.0),
    st.floats(min_value=0.0, max_value=3.4e38, allow_subnormal=True))
TOP_PS = st.one_of(st.just(1.0), st.floats(min_value=0.0, max_value=1.0, exclude_min=True, allow_subnormal=True))
SCALES = st.sampled_from([1.0, 20.0, 1e4, 1e30, 3e38])


def _logits(seed: int, vocab: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # uniform in [-scale, scale]: at 3e38 the spread is the whole finite float32 range
    return ((torch.rand(vocab, generator=g) * 2 - 1) * scale).float()


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**31), vocab=st.integers(2, 600), scale=SCALES, temperature=TEMPERATURES,
       top_p=TOP_PS, step=st.integers(0, 5000), rseed=st.integers(0, 2**64 - 1))
def test_every_admitted_value_gives_a_token_in_vocabulary(seed, vocab, scale, temperature, top_p, step, rseed):
    check_sampling(1, temperature, top_p)  # the generator only produces admitted values
    logits = _logits(seed, vocab, scale)
    p = SamplingParams(temperature=temperature, top_p=top_p, seed=rseed)
    tok = sample_one(logits, p, step)
    assert isinstance(tok, int) and 0 <= tok < vocab
    if not p.is_greedy:
        probs = _probs(logits, p)
        assert bool(torch.isfinite(probs).all()) and bool((probs >= 0).all())
        assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-3) or top_p < 1.0
        assert float(probs[tok]) > 0  # never a token the distribution excludes
        assert float(probs.max()) > 0  # the most likely token always keeps weight (ties may pick either)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31), vocab=st.integers(2, 600), scale=SCALES,
       temperature=st.floats(min_value=0.0, max_value=GREEDY_BELOW, exclude_max=True, allow_subnormal=True),
       top_p=TOP_PS, rseed=st.integers(0, 2**64 - 1))
def test_tiny_temperature_is_greedy_argmax(seed, vocab, scale, temperature, top_p, rseed):
    logits = _logits(seed, vocab, scale)
    p = SamplingParams(temperature=temperature, top_p=top_p, seed=rseed)
    assert p.is_greedy
    want = int(torch.argmax(logits))
    assert sample_one(logits, p, 3) == want
    assert sample(torch.stack([logits, logits]), [p, SamplingParams(temperature=1.0, seed=1)], [3, 3])[0] == want


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**31), gap=st.floats(min_value=1.0, max_value=3e38))
def test_just_above_the_cut_off_a_clear_winner_wins(seed, gap):
    """At the smallest sampled temperature the distribution is one-hot for any logit gap >= 1: no overflow
    turns that into NaN or into a uniform draw."""
    logits = _logits(seed, 64, 1.0)
    best = int(logits.argmax())
    logits[best] = min(float(logits.max()) + gap, 3.4e38)
    p = SamplingParams(temperature=GREEDY_BELOW, seed=seed)
    assert sample_one(logits, p, 0) == best


@settings(max_examples=100, deadline=None)
@given(params=st.lists(st.tuples(TEMPERATURES, TOP_PS, st.integers(0, 2**64 - 1)), min_size=1, max_size=8),
       seed=st.integers(0, 2**31), scale=SCALES)
def test_batch_rows_equal_their_single_draws(params, seed, scale):
    sp = [SamplingParams(temperature=t, top_p=p, seed=s) for t, p, s in params]
    logits = torch.stack([_logits(seed + i, 300, scale) for i in range(len(sp))])
    steps = list(range(len(sp)))
    assert sample(logits, sp, steps) == [sample_one(logits[i], sp[i], steps[i]) for i in range(len(sp))]


def test_non_finite_logits_fail_their_row_alone():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    sp = [SamplingParams(temperature=0.7, seed=i) for i in range(4)]
    out = sample(logits, sp, [1, 1, 1, 1])
    assert isinstance(out[1], SamplingError) and isinstance(out[2], SamplingError)
    assert out[0] == sample_one(logits[0], sp[0], 1) and out[3] == sample_one(logits[3], sp[3], 1)
    assert all(isinstance(out[i], int) and 0 <= out[i] < 50 for i in (0, 3))
