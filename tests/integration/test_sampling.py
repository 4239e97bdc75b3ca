"""Sampling options through a real stack over gRPC, each against an independent path: stop token ids and stop
strings against an unstopped greedy run, log-probabilities and penalties against transformers, seeded sampling
with every option against the sampler run on transformers' logits, and a deadline that expires."""
import time

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from pdserve.client import build_request, generate
from pdserve.common.proto import common_pb2
from pdserve.engine.sampler import SamplingParams, sample_one
from pdserve.engine.tokenizer import load_tokenizer
from tests.integration.helpers import prompt, wait_no_leases
from tests.oracle import TOLERANCE

STOP = common_pb2.FINISH_REASON_STOP


def _run(stack, **kw) -> dict:
    out = stack.generate(**kw)
    assert "error" not in out, out
    return out


def _messages(stack, **kw) -> list:
    return list(stack.gateway.Generate(build_request(**kw), timeout=60))


def _no_leases(stack):
    assert all(s.num_leased == 0 for s in wait_no_leases(stack)), stack.pool_states()


def test_stop_token_id_ends_the_output_without_its_text(stack, model_dir):
    p = prompt(37, 1)
    full = _run(stack, prompt_token_ids=p, max_tokens=24, ignore_eos=True)["token_ids"]
    k = next(i for i in range(3, len(full)) if full[i] not in full[:i])  # its first occurrence is at k
    out = _run(stack, prompt_token_ids=p, max_tokens=24, ignore_eos=True, stop_token_ids=[full[k]])
    assert out["token_ids"] == full[:k + 1] and out["finish_reason"] == "stop", (out, full, k)
    assert out["text"] == load_tokenizer(model_dir, 512).decode(full[:k])
    _no_leases(stack)


def test_stop_string_across_tokens_cuts_the_text_and_releases_the_pages(stack):
    kw = dict(prompt="the river runs under the old bridge", max_tokens=40, ignore_eos=True)
    full = _messages(stack, **kw)
    texts = [m.text for m in full]
    ends = [len("".join(texts[:i + 1])) for i in range(len(texts))]
    # a stop string made of the end of one token's text and the start of a later one's
    m = next(i for i in range(len(texts) // 3, len(texts) - 1) if texts[i] and texts[i + 1])
    whole = "".join(texts)
    stop = whole[ends[m] - 1:ends[m] + 1]
    at = whole.find(stop)
    last = next(i for i, e in enumerate(ends) if e >= at + len(stop))  # the token that completes it
    steps = stack.metric("decode", "pdserve_forward_seconds_count", {"phase": "decode"})
    got = _messages(stack, **{**kw, "max_tokens": 2000}, stop=[stop, "never appears \x00"])
    assert "".join(g.text for g in got) == whole[:at], (stop, whole)
    assert [t for g in got for t in g.token_ids] == [t for f in full[:last + 1] for t in f.token_ids]
    assert got[-1].finish_reason == STOP and all(g.finish_reason == 0 for g in got[:-1])
    _no_leases(stack)  # the decode stream, still running, was cancelled and its pages given back...
    # ... long before its 2000 tokens (a few more steps may run while the cancellation travels)
    assert stack.metric("decode", "pdserve_forward_seconds_count", {"phase": "decode"}) - steps < 1000


def _check_logprobs(got: dict, row: torch.Tensor, tok: int, n: int) -> None:
    assert abs(got["logprob"] - float(row[tok])) < TOLERANCE
    ids, vals = [t for t, _ in got["top"]], [v for _, v in got["top"]]
    want_vals, want_ids = row.topk(n)
    assert len(ids) == n and max(abs(a - float(b)) for a, b in zip(vals, want_vals)) < TOLERANCE
    # the same tokens, except where the reference itself has a near tie
    assert all(a == b or abs(float(row[a] - row[b])) < TOLERANCE for a, b in zip(ids, want_ids.tolist()))


def test_logprobs_and_prompt_logprobs_equal_transformers(stack, oracle):
    p = prompt(33, 5)
    out = _run(stack, prompt_token_ids=p, max_tokens=9, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    ids = out["token_ids"]
    lp = torch.log_softmax(oracle.hf_logits(p + ids), -1)  # row i: the distribution of token i + 1
    assert len(out["logprobs"]) == len(ids) == 9
    for j, (tok, got) in enumerate(zip(ids, out["logprobs"])):
        _check_logprobs(got, lp[len(p) - 1 + j], tok, 5)
    assert out["prompt_token_ids"] == p and len(out["prompt_logprobs"]) == len(p) - 1
    for i, got in enumerate(out["prompt_logprobs"]):
        _check_logprobs(got, lp[i], p[i + 1], 3)
    plain = _run(stack, prompt_token_ids=p, max_tokens=9, ignore_eos=True, logprobs=0)
    assert plain["token_ids"] == ids and all(g["top"] == [] for g in plain["logprobs"])
    assert "prompt_logprobs" not in plain


REP = 2.0


@pytest.fixture(scope="module")
def repeat_prompt(oracle) -> list[int]:
    """A prompt whose next token changes under repetition penalty REP (its arg-max is a prompt token), found with
    transformers: prefill's first token is then wrong unless prefill applies the penalty as decode does."""
    prompts = [prompt(200, seed) for seed in range(100, 108)]
    with torch.inference_mode():
        last = oracle.hf(torch.tensor(prompts)).logits[:, -1].float()
    for p, row in zip(prompts, last):
        penalised = RepetitionPenaltyLogitsProcessor(REP)(torch.tensor([p]), row[None].clone())[0]
        if float(row.max() - row.topk(2).values[1]) > 0.01 and float(
                penalised.max() - penalised[int(row.argmax())]) > 0.01:
            return p
    raise AssertionError("no prompt among 8 has an arg-max the repetition penalty moves")


def test_penalties_change_greedy_output_as_transformers_says(stack, oracle, repeat_prompt):
    p = repeat_prompt
    kw = dict(prompt_token_ids=p, max_tokens=16, ignore_eos=True)
    plain = _run(stack, **kw)["token_ids"]
    freq, pres, rep = 1.5, 0.5, REP
    ids = _run(stack, **kw, frequency_penalty=freq, presence_penalty=pres, repetition_penalty=rep)["token_ids"]
    assert ids[0] != plain[0]  # the penalty changed prefill's token already
    logits = oracle.hf_logits(p + ids)
    for j, tok in enumerate(ids):
        out = ids[:j]
        row = RepetitionPenaltyLogitsProcessor(rep)(torch.tensor([p + out]), logits[len(p) - 1 + j][None].clone())[0]
        for t in set(out):  # the OpenAI formula, over output tokens only
            row[t] -= freq * out.count(t) + pres
        assert float(row[tok]) > float(row.max()) - TOLERANCE, (j, tok, int(row.argmax()))


def test_seeded_sampling_with_every_option_equals_the_sampler_on_transformers_logits(stack, oracle, repeat_prompt):
    """Prefill draws step 0 and decode the rest: the same tokens as one process drawing every step."""
    p = repeat_prompt
    opts = dict(temperature=0.3, top_p=0.95, top_k=40, seed=1234, frequency_penalty=0.4, presence_penalty=0.2,
                repetition_penalty=REP)
    ids = _run(stack, prompt_token_ids=p, max_tokens=14, ignore_eos=True, **opts)["token_ids"]
    params = SamplingParams(**opts)
    logits = oracle.hf_logits(p + ids)
    want = [sample_one(logits[len(p) - 1 + j], params, j, p, ids[:j]) for j in range(len(ids))]
    assert ids == want


def test_bad_options_are_refused_before_any_lease(stack):
    for kw, reason, numbers in [(dict(stop=["a"] * 5), "BAD_STOP", ["5", "4"]),
                                (dict(top_k=513), "BAD_TOP_K", ["513", "512"]),
                                (dict(repetition_penalty=0.0), "BAD_PENALTY", ["0.0"]),
                                (dict(logprobs=21), "BAD_LOGPROBS", ["21", "20"])]:
        out = stack.generate(prompt_token_ids=[5, 6, 7], max_tokens=4, **kw)
        assert out["error"]["code"] == "INVALID_ARGUMENT" and out["error"]["reason"] == reason, out
        assert all(n in out["error"]["message"] for n in numbers), out


def test_expired_deadline_ends_the_request_and_leaves_no_lease(stack):
    p = prompt(40, 12)
    sent = stack.metric("prefill", "pdserve_kv_transfer_bytes_total")
    stack.arm("prefill", "prefill.delay_before_write", arg="3000")  # far past the 1 s deadline
    out = generate(stack.gateway, build_request(prompt_token_ids=p, max_tokens=8, ignore_eos=True), timeout=1.0)
    assert out["error"]["code"] == "DEADLINE_EXCEEDED", out
    # prefill's work outlives its caller (a write never stops half-way), but past the deadline it posts nothing
    until = time.monotonic() + 20
    while stack.prefills[0].GetInfo(common_pb2.GetInfoRequest(), timeout=5).queue_depth and time.monotonic() < until:
        time.sleep(0.05)
    assert stack.metric("prefill", "pdserve_kv_transfer_bytes_total") == sent
    assert all(s.num_leased == 0 for s in wait_no_leases(stack, timeout=20)), stack.pool_states()
    assert len(_run(stack, prompt_token_ids=p, max_tokens=8, ignore_eos=True)["token_ids"]) == 8
