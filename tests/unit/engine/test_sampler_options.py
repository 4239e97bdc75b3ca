"""Sampling options against independent paths: repetition penalty and top-k against transformers' logits
processors, frequency and presence penalties against the plain OpenAI formula, log-probabilities against a
log-sum-exp in plain Python; penalised rows batched equal their single draws."""
import math
import random

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor, TopKLogitsWarper

from pdserve.engine.sampler import SamplingParams, _probs, apply_penalties, logprobs, sample, sample_one

V = 300


def _case(seed: int, n_prompt: int = 40, n_out: int = 25):
    r = random.Random(seed)
    logits = torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 4
    # repeats guaranteed: draws from a small range
    return logits, [r.randrange(0, 60) for _ in range(n_prompt)], [r.randrange(30, 90) for _ in range(n_out)]


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    for seed in range(5):
        logits, prompt, out = _case(seed)
        want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + out]), logits[None].clone())[0]
        got = apply_penalties(logits[None], [SamplingParams(repetition_penalty=penalty)], [prompt], [out])[0]
        assert torch.allclose(got, want, atol=1e-6)
        assert not torch.allclose(got, logits)


@pytest.mark.parametrize("freq,pres", [(0.7, 0.0), (0.0, -1.1), (2.0, 1.5), (-2.0, 0.3)])
def test_frequency_and_presence_follow_the_openai_formula_over_output_only(freq, pres):
    logits, prompt, out = _case(7)
    got = apply_penalties(logits[None], [SamplingParams(frequency_penalty=freq, presence_penalty=pres)],
                          [prompt], [out])[0].tolist()
    for t in range(V):
        c = out.count(t)  # the prompt does not count
        want = float(logits[t]) - c * freq - (1.0 if c else 0.0) * pres
        assert math.isclose(got[t], want, rel_tol=1e-6, abs_tol=1e-5), t


@pytest.mark.parametrize("k", [1, 5, 50, V])
def test_top_k_keeps_what_transformers_keeps(k):
    logits, _, _ = _case(3)
    p = SamplingParams(temperature=0.7, top_k=k)
    want = torch.softmax(TopKLogitsWarper(k)(None, (logits / 0.7)[None])[0], -1)
    assert torch.allclose(_probs(logits, p), want, atol=1e-6)
    assert int((_probs(logits, p) > 0).sum()) == k


def test_top_k_and_top_p_draws_stay_in_top_k():
    logits, _, _ = _case(4)
    top = set(torch.topk(logits, 3).indices.tolist())
    draws = {sample_one(logits, SamplingParams(temperature=5.0, top_k=3, top_p=0.99, seed=s), s) for s in range(300)}
    assert draws == top


def test_greedy_with_penalties_is_the_argmax_of_the_penalised_logits():
    logits, prompt, out = _case(11)
    best = int(logits.argmax())
    out = out + [best] * 3
    p = SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=1.5)
    want = int(apply_penalties(logits[None], [p], [prompt], [out])[0].argmax())
    assert want != best  # the penalty changed the choice
    assert sample_one(logits, p, 0, prompt, out) == want
    assert sample(logits[None], [p], [0], [prompt], [out]) == [want]


def test_penalised_batch_rows_equal_their_single_draws():
    cases = [_case(s) for s in range(6)]
    logits = torch.stack([c[0] for c in cases])
    params = [SamplingParams(), SamplingParams(temperature=0.9, seed=1, repetition_penalty=1.2, top_k=40),
              SamplingParams(temperature=0.0, frequency_penalty=1.0), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.6, seed=9, presence_penalty=-0.5, top_p=0.8),
              SamplingParams(temperature=0.0, repetition_penalty=3.0)]
    prompts, outs = [c[1] for c in cases], [c[2] for c in cases]
    steps = [4, 5, 6, 7, 8, 9]
    got = sample(logits, params, steps, prompts, outs)
    assert got == [sample_one(logits[i], params[i], steps[i], prompts[i], outs[i]) for i in range(6)]
    assert logits.equal(torch.stack([c[0] for c in cases]))  # the caller's logits are not penalised in place


def test_penalised_rows_without_history_are_refused():
    with pytest.raises(ValueError, match="1 rows have penalties"):
        sample(torch.zeros(2, V), [SamplingParams(), SamplingParams(presence_penalty=1.0)], [0, 0])


def test_extreme_repetition_penalty_saturates_instead_of_overflowing():
    logits, prompt, out = _case(5)
    for penalty in (1e-30, 1e30):
        x = apply_penalties(logits[None], [SamplingParams(repetition_penalty=penalty)], [prompt], [out])[0]
        assert bool(torch.isfinite(x).all())
        assert 0 <= sample_one(logits, SamplingParams(temperature=1.0, repetition_penalty=penalty, seed=1), 0,
                               prompt, out) < V


def test_logprobs_are_the_raw_log_softmax_with_the_top_n():
    logits = torch.stack([_case(s)[0] for s in range(3)])
    got = logprobs(logits, [5, 17, 200], [0, 3, 20])
    for row, tok, n, lp in zip(logits.tolist(), [5, 17, 200], [0, 3, 20], got):
        m = max(row)
        lse = m + math.log(sum(math.exp(x - m) for x in row))
        assert math.isclose(lp.logprob, row[tok] - lse, abs_tol=1e-5)
        order = sorted(range(V), key=lambda t: -row[t])[:n]
        assert lp.top_ids == order
        assert all(math.isclose(a, row[t] - lse, abs_tol=1e-5) for a, t in zip(lp.top_logprobs, order))


def test_logprobs_in_chunks_equal_one_piece():
    logits = torch.randn(37, V, generator=torch.Generator().manual_seed(8))
    tokens, tops = list(range(37)), [i % 4 for i in range(37)]
    assert logprobs(logits, tokens, tops, chunk=5) == logprobs(logits, tokens, tops, chunk=64)
    assert logprobs(logits[:0], [], []) == []
