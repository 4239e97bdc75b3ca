"""A 16,384-token prompt through the whole stack (issue 19): prefill computes it in chunked passes, its KV goes to
decode's pool over Mooncake, decode generates over it, and every streamed token passes teacher forcing against
transformers' SDPA reference (tests/oracle.py LongOracle), whose memory grows with the length, not its square.

The long preset (max_position_embeddings 1,048,576) is a bf16 checkpoint; here it is served with --dtype float32
(bf16 -> float32 is exact, so these are the checkpoint's own weights), and so is its KV. That keeps DESIGN §7's
1e-3 rule, for the arg-max and for each served token's logprob, where the bf16 tolerance (~0.9,
tests/unit/engine/bf16_oracle.py) would be blind: at this length one page read from the wrong place is 16 keys of
16,384. Measured with decode reading a zeroed page in place of one prompt page: page 512 made token 14 a token
0.013 under the reference's best, page 0 token 3 (0.029 under), page 1023 changed no token but moved a served
logprob by 0.10; the clean run is within 1.4e-5 of the reference. Pools are as large as the context (17,408
tokens, 68 MiB each in float32): no override is involved. The 32,768-token case, and the reference's peak memory,
are in bench/scenarios/long_prompt.py."""
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.engine.make_model import make_model
from pdserve.engine.tags import TAG_NBYTES
from tests.integration.helpers import prompt
from tests.integration.stack import Stack
from tests.oracle import LongOracle, OracleMismatch, check_response_rows, check_served_logprobs

PROMPT, MAX_TOKENS, PASS_TOKENS = 16_384, 32, 2048
CONTEXT = PROMPT + 1024
PAGE_SIZE = 16
KV_BYTES_PER_TOKEN = 4 * 2 * 4 * 32 * 4  # layers x (K, V) x KV heads x head_dim x float32
FLOAT32 = ["--dtype", "float32"]
# the prompt's prefill took ~50 s on a 2-core machine busy with other work, near the 60 s defaults of the gateway's
# prefill and token-gap bounds (and within decode's 120 s wait for the write): those bound a service that hangs,
# and would end a long prompt on a slow host
PATIENT = {"gateway": ["--prefill-timeout", "600", "--token-timeout", "600"],
           "decode": ["--allocation-timeout", "600"]}


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("long")), "long")


def _counters(stack) -> dict[str, float]:
    return {"passes": stack.metric("prefill", "pdserve_prefill_batch_sequences_count"),
            "prompts": stack.metric("prefill", "pdserve_prefill_sequences_total"),
            "bytes": stack.metric("prefill", "pdserve_kv_transfer_bytes_total"),
            "violations": stack.metric("decode", "pdserve_lease_violations_total")}


def test_a_16384_token_prompt_is_chunked_transferred_decoded_and_every_token_passes_the_reference(long_dir):
    with ThreadPoolExecutor(1) as bg:
        # the reference loads, and later runs the prompt, beside the stack: CI's second core is otherwise idle
        loading = bg.submit(LongOracle, long_dir)
        stack = Stack(long_dir, context_length=CONTEXT, prefill_pool_tokens=CONTEXT, decode_pool_tokens=CONTEXT,
                      extra={"prefill": [*FLOAT32, "--prefill-max-batch-tokens", str(PASS_TOKENS)],
                             "decode": [*FLOAT32, *PATIENT["decode"]], "gateway": PATIENT["gateway"]})
        try:
            for service in ("prefill", "decode"):
                log = "".join(stack.procs[service][0].lines)
                assert "in float32 on cpu; KV pool" in log and f"float32, {KV_BYTES_PER_TOKEN} bytes/token" in log, \
                    log[-3000:]
            oracle = loading.result()
            p = prompt(PROMPT, 19_16384)
            before = _counters(stack)
            state = bg.submit(oracle.prompt_state, p)
            out = stack.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
            after = _counters(stack)
            state = state.result()
        finally:
            stack.close()
    assert "error" not in out, out
    tokens = out["token_ids"]
    assert len(tokens) == MAX_TOKENS and len(set(tokens)) > 1, tokens
    assert out["prompt_tokens"] == PROMPT, out
    # one prompt, in 8 forward passes of 2,048 tokens: each later pass read the earlier ones' KV back from the pool
    assert after["prompts"] - before["prompts"] == 1
    assert after["passes"] - before["passes"] == PROMPT // PASS_TOKENS
    # every prompt page went to decode's pool over Mooncake, data and tag, and no more
    pages = PROMPT // PAGE_SIZE
    assert after["bytes"] - before["bytes"] == pages * (PAGE_SIZE * KV_BYTES_PER_TOKEN + TAG_NBYTES)
    assert after["violations"] == before["violations"] == 0
    rows = oracle.rows(p, tokens, state)
    check_response_rows(rows, PROMPT, tokens, "transformers SDPA reference")
    # and each token's served logprob: a wrong page can move the logits without changing the winner
    check_served_logprobs(rows, tokens, [lp["logprob"] for lp in out["logprobs"]], "transformers SDPA reference")
    # the comparison is not vacuous: the same tokens one position late fail it
    with pytest.raises(OracleMismatch):
        check_response_rows(rows[1:], PROMPT, tokens[:-1], "the reference one row ahead")
