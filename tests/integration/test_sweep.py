"""On the default stack: a late write of data alone into a running request's prompt page ends that request with
DATA_LOSS within the checksum sweep's bound while the rest of its batch passes the oracle (issue 9, hole 3); a
temperature that overflowed float32 beside eight greedy streams fails nobody (hole 9)."""
import math
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.integration.helpers import allocate, collect, decode_stream, prefill, prompt

PAGE_SIZE = 16        # the default stack's
SWEEP_PAGES = 8       # decode's default --checksum-sweep-pages
SWEEP_EVERY = 8       # decode's default --checksum-sweep-every


def _pages(n: int) -> int:
    return -(-n // PAGE_SIZE)


def test_data_only_write_into_a_prompt_page_fails_that_request_within_the_sweep_bound(stack, oracle):
    others = [prompt(50 + 17 * i, 300 + i) for i in range(8)]
    victim = prompt(45, 399)  # 3 prompt pages; its own tokens land in the third from the first step
    max_tokens = 120
    streams = []
    for p in others:
        rid, dest = allocate(stack, len(p), max_tokens)
        streams.append(iter(decode_stream(stack, rid, p, prefill(stack, rid, p, dest, max_tokens), max_tokens)))
    heads = [[next(s).token_id, next(s).token_id] for s in streams]  # the second token proves each one runs
    before = stack.metric("decode", "pdserve_lease_violations_total",
                          {"service": "decode", "reason": "PROMPT_PAGE_CHANGED"})
    # fires before the first step of the newest running request, which is the victim: every other has stepped
    stack.arm("decode", "decode.rogue_data_write", arg="1")
    rid, dest = allocate(stack, len(victim), max_tokens)
    got, err = collect(decode_stream(stack, rid, victim, prefill(stack, rid, victim, dest, max_tokens), max_tokens))
    with ThreadPoolExecutor(8) as pool:
        rest = list(pool.map(collect, streams))
    assert err is not None and (err.code, err.reason) == (grpc.StatusCode.DATA_LOSS, "PROMPT_PAGE_CHANGED"), (err, got)
    assert "prompt page 1" in err.message, err.message
    # the write came before the victim's first step, so every token but prefill's first came after it; the
    # sweep re-checks every prompt page of the batch within E * ceil(P / N) steps, so at most that minus one
    bound = SWEEP_EVERY * math.ceil((sum(_pages(len(p)) for p in others) + _pages(len(victim))) / SWEEP_PAGES)
    assert 1 <= len(got) and len(got) - 1 <= bound - 1, (len(got), bound)
    pairs = []
    for p, head, (tail, e) in zip(others, heads, rest):
        assert e is None, e
        assert len(head + tail) == max_tokens
        pairs.append((p, head + tail))
    oracle.check_many(pairs)
    assert stack.metric("decode", "pdserve_lease_violations_total",
                        {"service": "decode", "reason": "PROMPT_PAGE_CHANGED"}) == before + 1
    assert stack.metric("decode", "pdserve_guard_seconds_count", {"kind": "checksum_sweep"}) > 0
    assert stack.metric("decode", "pdserve_checksum_sweep_cycle_steps") >= 0


@pytest.mark.parametrize("temperature", [5e-38, 1e-40])
def test_overflowing_temperature_beside_eight_greedy_streams(stack, oracle, temperature):
    """5e-38 is the issue's value; 1e-40 (a float32 subnormal) overflows logits / T for any logit above 3.4e-2,
    so before the fix it raised on every model. The odd stream completes: a temperature under 1e-5 is greedy,
    so its tokens must be the arg-max, which the oracle checks."""
    healthy = [prompt(30 + 11 * i, 500 + i) for i in range(8)]
    odd = prompt(40, 599)
    max_tokens = 48
    with ThreadPoolExecutor(9) as pool:
        futures = [pool.submit(stack.generate, prompt_token_ids=p, max_tokens=max_tokens, ignore_eos=True)
                   for p in healthy]
        strange = pool.submit(stack.generate, prompt_token_ids=odd, max_tokens=max_tokens, ignore_eos=True,
                              temperature=temperature, top_p=0.9, seed=12345)
        results = [f.result() for f in futures]
        out = strange.result()
    for r in results:
        assert "error" not in r, r
        assert len(r["token_ids"]) == max_tokens
    oracle.check_many([(p, r["token_ids"]) for p, r in zip(healthy, results)])
    assert "error" not in out, out
    assert len(out["token_ids"]) == max_tokens
    oracle.check(odd, out["token_ids"])
