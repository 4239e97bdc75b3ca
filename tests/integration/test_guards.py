"""Guards on the default stack: a late write under a live request, bad input, client disconnects."""
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from pdserve.client import build_request
from pdserve.engine.tags import TAG_NBYTES
from pdserve.kvtransfer.engine import Run, TransferEngine
from tests.integration.helpers import allocate, collect, decode_stream, prefill, prompt, wait_no_leases

VICTIM_TOKENS = 3000  # 200 + 3,000 tokens, within the 4,096 context


def test_tag_overwritten_under_live_request_fails_it_alone(stack, oracle):
    """A rogue one-sided write (a late writer) lands on a live request's tag: that request ends with
    DATA_LOSS at its next step; the requests batched with it finish and pass the oracle."""
    others = [(prompt(60 + 13 * i, 100 + i), 40) for i in range(8)]
    victim = prompt(200, 21)
    # the rogue engine is up before the victim's stream starts, and the victim asks for far more tokens than the
    # few steps the write takes to land: with the native decode step a 300-token victim could finish before it
    rogue = TransferEngine()
    garbage = torch.full((TAG_NBYTES // 8,), 0x5A5A5A5A, dtype=torch.int64)
    rogue.register(garbage.data_ptr(), TAG_NBYTES)
    rid, dest = allocate(stack, len(victim), VICTIM_TOKENS)
    resp = prefill(stack, rid, victim, dest, VICTIM_TOKENS)
    stream = iter(decode_stream(stack, rid, victim, resp, VICTIM_TOKENS))
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(stack.generate, prompt_token_ids=p, max_tokens=m, ignore_eos=True) for p, m in others]
        got = [next(stream).token_id for _ in range(3)]
        page = dest.leases[1].page
        rogue.write(dest.transfer_session, [Run(garbage.data_ptr(), dest.tag_base + page * TAG_NBYTES, TAG_NBYTES)],
                    stage="late")
        rest, err = collect(stream)
        results = [f.result() for f in futures]
    assert err is not None and err.code == grpc.StatusCode.DATA_LOSS and err.reason == "STEP_TAG_MISMATCH", err
    tokens = got + rest
    assert len(tokens) < VICTIM_TOKENS
    oracle.check(victim, tokens)  # what was sent was computed before the page was touched
    for (p, m), out in zip(others, results):
        assert "error" not in out, out
        assert len(out["token_ids"]) == m
        oracle.check(p, out["token_ids"])
    assert stack.metric("decode", "pdserve_lease_violations_total",
                        {"service": "decode", "reason": "STEP_TAG_MISMATCH"}) >= 1


BAD = [
    (dict(prompt_token_ids=[], prompt="", max_tokens=4), "EMPTY_PROMPT"),
    (dict(prompt_token_ids=[5, 6], max_tokens=0), "BAD_MAX_TOKENS"),
    (dict(prompt_token_ids=[5, 6], max_tokens=4095), "CONTEXT_EXCEEDED"),
    (dict(prompt_token_ids=[5, 512, 6], max_tokens=4), "TOKEN_OUT_OF_VOCAB"),
    (dict(prompt_token_ids=[5, -1], max_tokens=4), "TOKEN_OUT_OF_VOCAB"),
    (dict(prompt_token_ids=[5, 6], max_tokens=4, temperature=-0.5), "BAD_TEMPERATURE"),
    (dict(prompt_token_ids=[5, 6], max_tokens=4, temperature=float("nan")), "BAD_TEMPERATURE"),
    (dict(prompt_token_ids=[5, 6], max_tokens=4, top_p=0.0), "BAD_TOP_P"),
    (dict(prompt_token_ids=[5, 6], max_tokens=4, top_p=1.5), "BAD_TOP_P"),
]


@pytest.mark.parametrize("kw,reason", BAD, ids=[r for _, r in BAD])
def test_bad_input_is_invalid_argument_and_service_keeps_serving(stack, oracle, kw, reason):
    out = stack.generate(**kw)
    assert out["error"]["code"] == "INVALID_ARGUMENT" and out["error"]["reason"] == reason, out
    assert out["token_ids"] == []
    good = prompt(20, 99)
    ok = stack.generate(prompt_token_ids=good, max_tokens=5, ignore_eos=True)
    assert "error" not in ok
    oracle.check(good, ok["token_ids"])


def test_cli_json_output_and_error_exit_code(stack, oracle):
    gw = stack.procs["gateway"][0].target
    cli = [sys.executable, "-m", "pdserve.cli", "generate", "--gateway", gw, "--json"]
    ok = subprocess.run(cli + ["--prompt-token-ids", "7,8,9,10", "--max-tokens", "6", "--ignore-eos"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)
    assert set(out) == {"token_ids", "text", "prompt_tokens", "finish_reason"}
    assert out["prompt_tokens"] == 4 and len(out["token_ids"]) == 6 and out["finish_reason"] == "length"
    oracle.check([7, 8, 9, 10], out["token_ids"])
    bad = subprocess.run(cli + [""], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert json.loads(bad.stdout) == {"error": {"code": "INVALID_ARGUMENT", "reason": "EMPTY_PROMPT",
                                                "message": "prompt is empty (0 tokens)"}}


def test_client_disconnect_cancels_decode_and_frees_pages(stack, oracle):
    call = stack.gateway.Generate(build_request(prompt_token_ids=prompt(100, 55), max_tokens=2000,
                                                ignore_eos=True), timeout=60)
    got = [next(call) for _ in range(3)]
    assert len(got) == 3
    call.cancel()
    states = wait_no_leases(stack)
    assert all(s.num_leased == 0 for s in states), states
    good = prompt(30, 56)
    out = stack.generate(prompt_token_ids=good, max_tokens=8, ignore_eos=True)
    oracle.check(good, out["token_ids"])
