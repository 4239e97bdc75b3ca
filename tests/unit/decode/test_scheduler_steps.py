"""The scheduler's loop over a real model and pool: a data-only change to one running request's prompt page
ends that request with DATA_LOSS within the sweep's bound while the others finish with teacher-forced tokens;
one request whose sampling raises ends alone (SAMPLING_FAILED) while the others of the step get their tokens."""
import asyncio
import math
import random

import grpc
import pytest
import torch

from pdserve.common.errors import PdError
from pdserve.common.metrics import LEASE_VIOLATIONS, SAMPLING_FAILURES
from pdserve.decode.scheduler import Scheduler, Sequence
from pdserve.decode.sweep import PromptRecord
from pdserve.engine import sampler
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampler import SamplingParams
from pdserve.engine.tags import expected_tags, make_tags
from tests.oracle import check_teacher_forced

PS = 16
EPOCH = 77
BUDGET = 2


@pytest.fixture(scope="module")
def runner(model_dir):
    return ModelRunner(model_dir, num_pages=96, page_size=PS, device="cpu")


def _prompt(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(2, 512) for _ in range(n)]


def _admit(runner, owner_byte: int, prompt: list[int], first_page: int, max_tokens: int,
           sampling: SamplingParams) -> Sequence:
    """What prefill and verification leave: prompt KV (tail zeroed), tags with checksums, and the record."""
    owner, pool = bytes([owner_byte]) * 16, runner.pool
    n = -(-len(prompt) // PS)
    num_pages = -(-(len(prompt) + max_tokens - 1) // PS)
    leases = [(first_page + i, 5 + i) for i in range(num_pages)]
    pages = [p for p, _ in leases]
    logits = runner.prefill(prompt, pages[:n])
    pool.zero_tail(pages[n - 1], len(prompt) - (n - 1) * PS)
    checksums = pool.checksums(pages[:n])
    pool.tags[pages[:n]] = make_tags(owner, EPOCH, [g for _, g in leases[:n]], len(prompt), PS, checksums)
    seq = Sequence(owner, EPOCH, leases, expected_tags(owner, EPOCH, leases), len(prompt), sampling, frozenset(),
                   [int(logits[-1].argmax())])
    seq.prompt = PromptRecord.of(leases, len(prompt), PS, checksums)
    return seq


async def _drain(seq: Sequence) -> tuple[list[int], PdError | None]:
    toks = list(seq.generated)  # the first token, sent before the sequence runs
    while True:
        ev = await seq.events.get()
        if isinstance(ev, PdError):
            return toks, ev
        toks.append(ev[0])
        if ev[1]:
            return toks, None


def _run(runner, seqs: list[Sequence], before_start=lambda: None):
    async def main():
        released = []

        async def release(seq):
            released.append(seq.owner)
        s = Scheduler(runner, release, sweep_pages=BUDGET)
        for seq in seqs:
            s.add(seq)
        before_start()
        loop = asyncio.create_task(s.run())
        out = await asyncio.wait_for(asyncio.gather(*(_drain(q) for q in seqs)), 120)
        loop.cancel()
        await asyncio.sleep(0)
        assert sorted(released) == sorted(q.owner for q in seqs)  # every request gives its pages back once
        return out
    return asyncio.run(main())


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _check(runner, prompt, toks, who):
    ids = prompt + toks
    logits = runner.prefill(ids, list(range(80, 80 + -(-len(ids) // PS))), all_logits=True)
    check_teacher_forced(logits, prompt, toks, who)


def test_data_only_write_fails_the_request_within_the_bound(runner):
    # prompts end mid-page, so every request's own tokens land in its last prompt page from the first step
    prompts = [_prompt(37, 1), _prompt(21, 2), _prompt(50, 3)]
    max_tokens = 40
    seqs, page = [], 0
    for i, p in enumerate(prompts):
        seqs.append(_admit(runner, i + 1, p, page, max_tokens, _greedy(max_tokens)))
        page += len(seqs[-1].leases)
    victim = seqs[1]
    bound = math.ceil(sum(len(q.prompt.table) for q in seqs) / BUDGET)
    before = LEASE_VIOLATIONS.labels("decode", "PROMPT_PAGE_CHANGED")._value.get()
    tag = runner.pool.tags[victim.pages[1]].clone()

    def corrupt():  # a late write of data alone, after verification, before the first step
        runner.pool.kv[victim.pages[1], 2, 0, 3] += 0.5
    results = _run(runner, seqs, corrupt)
    toks, err = results[1]
    assert err is not None and (err.code, err.reason) == (grpc.StatusCode.DATA_LOSS, "PROMPT_PAGE_CHANGED"), err
    assert "prompt page 1" in err.message
    assert len(toks) - 1 <= bound - 1, (len(toks), bound)  # tokens after the write: at most bound - 1 steps
    assert torch.equal(runner.pool.tags[victim.pages[1]], tag)
    assert LEASE_VIOLATIONS.labels("decode", "PROMPT_PAGE_CHANGED")._value.get() == before + 1
    for i in (0, 2):
        toks, err = results[i]
        assert err is None and len(toks) == max_tokens
        _check(runner, prompts[i], toks, f"sequence {i}")


def test_one_sequences_sampling_failure_ends_it_alone(runner, monkeypatch):
    draw = sampler._draw

    def flaky(probs, params, step):
        if params.seed == 666 and step == 3:
            raise RuntimeError("injected: one row's draw fails")
        return draw(probs, params, step)
    monkeypatch.setattr(sampler, "_draw", flaky)
    prompts = [_prompt(19, 4), _prompt(30, 5), _prompt(12, 6)]
    max_tokens = 12
    params = [_greedy(max_tokens), SamplingParams(temperature=0.8, seed=666, max_tokens=max_tokens, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=max_tokens, ignore_eos=True)]
    seqs, page = [], 0
    for i, (p, sp) in enumerate(zip(prompts, params)):
        seqs.append(_admit(runner, 10 + i, p, page, max_tokens, sp))
        page += len(seqs[-1].leases)
    before = SAMPLING_FAILURES._value.get()
    results = _run(runner, seqs)
    toks, err = results[1]
    assert err is not None and (err.code, err.reason) == (grpc.StatusCode.INTERNAL, "SAMPLING_FAILED"), err
    assert "injected" in err.message
    assert len(toks) == 3  # steps 1 and 2 drew; step 3 failed and sent nothing
    assert SAMPLING_FAILURES._value.get() == before + 1
    toks, err = results[0]
    assert err is None and len(toks) == max_tokens
    _check(runner, prompts[0], toks, "greedy neighbour")
    toks, err = results[2]
    assert err is None and len(toks) == max_tokens
    # the sampled neighbour's tokens are its own draws: replay them over teacher-forced logits
    ids = prompts[2] + toks
    logits = runner.prefill(ids, list(range(80, 80 + -(-len(ids) // PS))), all_logits=True)
    for j in range(1, max_tokens):
        assert toks[j] == sampler.sample_one(logits[len(prompts[2]) - 1 + j], params[2], j), j
