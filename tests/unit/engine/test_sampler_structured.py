"""The sampler's structured-output and agent options: a grammar's mask per row, logit_bias, min_tokens and min_p;
rows without them take exactly the tokens they took before (bit for bit), and the logits are never changed (the
log-probabilities stay the model's)."""
import random

import torch

from pdserve.engine.grammar import GrammarSpec
from pdserve.engine.sampler import SamplingError, SamplingParams, advance, sample, sample_one

V = 64


def mask_of(allowed: list[int]) -> torch.Tensor:
    words = [0, 0]
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def unconstrained_rows():
    return [SamplingParams(), SamplingParams(temperature=0.9, seed=4, top_p=0.8),
            SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5), SamplingParams(temperature=0.7, seed=8,
                                                                                          top_k=5)]


def test_unconstrained_rows_are_bit_for_bit_unchanged_beside_constrained_ones():
    g = torch.Generator().manual_seed(0)
    plain = unconstrained_rows()
    constrained = [SamplingParams(grammar=GrammarSpec(json_object=True)),
                   SamplingParams(temperature=1.0, seed=3, grammar=GrammarSpec(json_object=True)),
                   SamplingParams(logit_bias=((5, 30.0),), min_tokens=4, min_p=0.2, temperature=1.0, seed=1)]
    prompts = [[1, 2, 3]] * 7
    outputs = [[4, 5]] * 7
    for trial in range(20):
        logits = torch.randn(7, V, generator=g) * 3
        alone = sample(logits[:4], plain, [2] * 4, prompts[:4], outputs[:4])
        rows = [0, 4, 1, 5, 2, 6, 3]  # interleaved: the unconstrained rows sit among the others
        mixed_params = [(plain + constrained)[r] for r in rows]
        masks = {1: mask_of([7, 9]), 3: mask_of([11])}
        before = logits[rows].clone()
        mixed = sample(logits[rows], mixed_params, [2] * 7, prompts, outputs, masks, eos_ids=(0,))
        assert [mixed[i] for i in (0, 2, 4, 6)] == alone
        assert mixed[1] in (7, 9) and mixed[3] == 11 and mixed[5] == 5  # 5: biased by +30, min_p drops the rest
        assert torch.equal(logits[rows], before)  # log-probabilities are of these, untouched


def test_greedy_under_a_mask_takes_the_best_allowed_token():
    x = torch.arange(V, dtype=torch.float32)
    p = SamplingParams(grammar=GrammarSpec(json_object=True))
    assert sample(x[None], [p], [0], masks={0: mask_of([3, 40, 12])}) == [40]
    assert sample_one(x, p, 0, mask=mask_of([3, 12])) == 12


def test_sampled_rows_draw_only_allowed_tokens():
    p = SamplingParams(temperature=5.0, seed=11, grammar=GrammarSpec(json_object=True))
    seen = {sample_one(torch.zeros(V), SamplingParams(**{**_fields(p), "seed": s}), 0, mask=mask_of([2, 33, 60]))
            for s in range(40)}
    assert seen == {2, 33, 60}


def _fields(p):
    return {k: getattr(p, k) for k in p.__slots__}


def test_a_row_with_no_allowed_token_fails_alone():
    p = SamplingParams(grammar=GrammarSpec(json_object=True))
    logits = torch.randn(2, V)
    out = sample(logits, [p, SamplingParams()], [0, 0], masks={0: mask_of([])})
    assert isinstance(out[0], SamplingError) and out[1] == int(logits[1].argmax())


def test_logit_bias_moves_greedy_and_sampled_choices():
    x = torch.zeros(V)
    x[10] = 5.0
    assert sample_one(x, SamplingParams(), 0) == 10
    assert sample_one(x, SamplingParams(logit_bias=((10, -100.0),)), 0) != 10
    assert sample_one(x, SamplingParams(logit_bias=((20, 6.0),)), 0) == 20
    assert sample(x[None].repeat(2, 1), [SamplingParams(), SamplingParams(logit_bias=((30, 50.0),))], [0, 0]) == [10, 30]
    drawn = {sample_one(x, SamplingParams(temperature=1.0, seed=s, logit_bias=((40, 100.0),)), 0) for s in range(20)}
    assert drawn == {40}


def test_min_tokens_holds_back_eos_and_stop_tokens_until_it_is_reached():
    x = torch.zeros(V)
    x[1], x[7], x[9] = 9.0, 8.0, 7.0  # 1: eos, 7: a stop token, 9: the best token left
    p = SamplingParams(min_tokens=2, stop_token_ids=(7,))
    assert [sample_one(x, p, step, eos_ids=(1,)) for step in range(3)] == [9, 9, 1]
    biased = SamplingParams(min_tokens=2, stop_token_ids=(7,), logit_bias=((30, 0.5),))  # shaped at every step
    assert [sample_one(x, biased, step, eos_ids=(1,)) for step in range(3)] == [9, 9, 1]
    assert sample(torch.stack([x, x]), [p, SamplingParams()], [1, 1], eos_ids=(1,)) == [9, 1]


def test_min_p_keeps_only_tokens_near_the_most_likely():
    x = torch.full((V,), -10.0)
    x[3], x[4], x[5] = 2.0, 2.0 + torch.log(torch.tensor(0.5)).item(), 2.0 + torch.log(torch.tensor(0.05)).item()
    drawn = {sample_one(x, SamplingParams(temperature=1.0, seed=s, min_p=0.1), 0) for s in range(60)}
    assert drawn == {3, 4}
    assert {sample_one(x, SamplingParams(temperature=1.0, seed=s, min_p=1.0), 0) for s in range(20)} == {3}


class _Refuses:
    def __init__(self, bad):
        self.bad = bad

    def accept(self, t):
        return None if t != self.bad else f"token {t} is not allowed here"


def test_advance_turns_a_refused_token_into_that_rows_error():
    tokens = [5, 6, SamplingError("x")]
    advance({0: _Refuses(5), 1: _Refuses(99), 2: _Refuses(0)}, tokens)
    assert isinstance(tokens[0], SamplingError) and "refused sampled token 5" in str(tokens[0])
    assert tokens[1] == 6 and isinstance(tokens[2], SamplingError)


def test_plain_rows_take_the_shared_arg_max():
    r = random.Random(0)
    logits = torch.tensor([[r.random() for _ in range(V)] for _ in range(5)])
    assert sample(logits, [SamplingParams()] * 5, [0] * 5) == logits.argmax(-1).tolist()
    assert not SamplingParams(min_tokens=3).is_plain_at(2) and SamplingParams(min_tokens=3).is_plain_at(3)
