"""Batched prefill on the default stack: prompts that arrive together share forward passes (a long one in chunks)
and every greedy response passes the oracle; a prompt whose deadline passes while it waits behind another is
dropped before its pass, and its write is acknowledged as never posted (its pages come back)."""
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.common.proto import decode_pb2, prefill_pb2
from tests.integration.helpers import allocate, collect, decode_stream, prefill, prompt, sampling, wait_no_leases

BATCHES = "pdserve_prefill_batch_sequences_count"  # forward passes
SEQUENCES = "pdserve_prefill_sequences_total"


def _wait_for(what: str, check, bound_s: float = 30.0) -> None:
    end = time.monotonic() + bound_s
    while not check():
        assert time.monotonic() < end, f"{what} did not happen within {bound_s}s"
        time.sleep(0.02)


def test_prompts_arriving_together_share_passes_and_pass_the_oracle(stack, oracle):
    # 2,111 tokens queue behind a pass that holds the model: the next pass packs 2,048 of them, chunking one
    long = prompt(1200, 7)
    short = [prompt(n, 1000 + n) for n in (1, 17, 64, 100, 129, 200, 400)]
    passes, seqs = stack.metric("prefill", BATCHES), stack.metric("prefill", SEQUENCES)
    stack.arm("prefill", "prefill.slow_forward", arg="1000")
    with ThreadPoolExecutor(9) as pool:
        blocker = pool.submit(stack.generate, prompt_token_ids=prompt(3, 5), max_tokens=2, ignore_eos=True)
        _wait_for("the held pass", lambda: stack.metric("prefill", BATCHES) > passes)
        chunks = stack.metric("prefill", BATCHES.replace("_count", "_sum"))
        outs = list(pool.map(lambda p: stack.generate(prompt_token_ids=p, max_tokens=6, ignore_eos=True),
                             [long, *short]))
        assert "error" not in blocker.result()
    for p, out in zip([long, *short], outs):
        assert "error" not in out, (len(p), out)
        assert out["prompt_tokens"] == len(p) and len(out["token_ids"]) == 6
    oracle.check(long, outs[0]["token_ids"])
    oracle.check_many([(p, out["token_ids"]) for p, out in zip(short, outs[1:])])
    assert stack.metric("prefill", SEQUENCES) - seqs == 9
    assert stack.metric("prefill", BATCHES) - passes < 9  # fewer passes than prompts: packed
    assert stack.metric("prefill", BATCHES.replace("_count", "_sum")) - chunks > 8  # more chunks than prompts


def test_work_whose_deadline_passes_in_the_queue_is_dropped_unrun(stack, oracle):
    dropped = stack.metric("prefill", "pdserve_prefill_dropped_total", {"reason": "deadline"})
    passes, seqs = stack.metric("prefill", BATCHES), stack.metric("prefill", SEQUENCES)
    gone = stack.metric("prefill", "pdserve_prefill_forward_for_gone_total")
    first, late = prompt(200, 11), prompt(20, 12)
    rid_first, dest_first = allocate(stack, len(first), 8)
    rid_late, dest_late = allocate(stack, len(late), 8)
    stack.arm("prefill", "prefill.slow_forward", arg="1000")
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(prefill, stack, rid_first, first, dest_first, 8)
        _wait_for("the first pass", lambda: stack.metric("prefill", BATCHES) > passes)
        with pytest.raises(grpc.RpcError) as info:
            stack.prefills[0].Prefill(prefill_pb2.PrefillRequest(request_id=rid_late, token_ids=late,
                                                                 sampling=sampling(8), destination=dest_late),
                                      timeout=0.5)
        resp = running.result()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    tokens, err = collect(decode_stream(stack, rid_first, first, resp, 8))
    assert err is None and len(tokens) == 8
    oracle.check(first, tokens)
    _wait_for("the drop", lambda: stack.metric("prefill", "pdserve_prefill_dropped_total",
                                               {"reason": "deadline"}) == dropped + 1)
    assert stack.metric("prefill", SEQUENCES) - seqs == 1  # only the first prompt's pass ran
    assert stack.metric("prefill", "pdserve_prefill_forward_for_gone_total") == gone
    stack.decodes[0].Release(decode_pb2.DecodeReleaseRequest(request_id=rid_late), timeout=10)
    # acknowledged as never posted: nothing waits out a quarantine
    states = wait_no_leases(stack)
    assert all(s.num_leased == 0 and s.num_quarantined == 0 for s in states), states
