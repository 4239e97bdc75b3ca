"""Pages on demand through the real stack (issue 19, point 2): decode leases a request's prompt pages plus a small
headroom and grows the lease as it generates (batched broker Extend calls), so 24 requests with max_tokens 4,000
(96,000 tokens if reserved up front, three times the 32,768-token pool) all stream at once; a chat request without
max_tokens leases only what it has used; a pool too small for its requests preempts the youngest (PREEMPTED) and
the gateway resubmits it as prompt + its tokens, so every stream completes and passes the oracle."""
import concurrent.futures
import json
import threading
import time
import urllib.request

import pytest

from pdserve.client import build_request
from pdserve.common.config import pages_for
from tests.integration.helpers import prompt, wait_no_leases
from tests.integration.stack import Stack


def _first_64(stack, ids: list[int], all_started: threading.Barrier) -> tuple[list[int], float]:
    """Streams a max_tokens 4,000 request; once it has its first token, waits (its stream open, its pages held)
    until all the others have theirs, then reads to 64 tokens and cancels. Returns (tokens, first token at)."""
    stream = stack.gateway.Generate(build_request(prompt_token_ids=ids, max_tokens=4000, ignore_eos=True),
                                    timeout=300)
    got, first = [], None
    for msg in stream:
        got.extend(msg.token_ids)
        if first is None:
            first = time.monotonic()
            all_started.wait()  # reserving prompt + max_tokens, the 9th would wait here for one of 8 to end
        if len(got) >= 64:
            break
    stream.cancel()
    return got[:64], first


def test_24_requests_of_4000_tokens_all_stream_at_once_on_a_32k_pool(stack, oracle):
    info = stack.pool_states()[0]
    assert info.num_pages * 16 == 32768 and 24 * pages_for(32 + 3999, 16) > info.num_pages  # could not reserve
    grown = stack.metric("decode", "pdserve_kv_growth_pages_total")
    prompts = [prompt(32, 900 + i) for i in range(24)]
    all_started = threading.Barrier(24, timeout=120)
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        results = list(pool.map(lambda p: _first_64(stack, p, all_started), prompts))
    assert not all_started.broken and all(len(r[0]) == 64 for r in results)
    print(f"first tokens of 24 requests within {max(r[1] for r in results) - start:.2f}s of their start")
    assert stack.metric("decode", "pdserve_kv_growth_pages_total") > grown
    oracle.check_many([(p, r[0]) for p, r in zip(prompts, results)])
    assert all(s.num_leased == 0 for s in wait_no_leases(stack, timeout=30))


def test_a_chat_request_without_max_tokens_leases_only_what_it_uses(stack):
    port = stack.procs["gateway"][0].http_port
    body = {"model": "pdserve-tiny", "messages": [{"role": "user", "content": "tell me everything"}], "stream": True,
            "ignore_eos": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    chunks = 0
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: {"):
                chunks += 1
            if chunks == 40:
                leased = stack.pool_states()[0].num_leased  # while it runs, ~4,000 tokens still to go
                break
    # its prompt (a chat template around a few words) plus ~40 tokens plus headroom and one growth: a few pages,
    # where reserving the rest of the context would take 4096 / 16 = 256
    assert 0 < leased <= 24, leased
    assert all(s.num_leased == 0 for s in wait_no_leases(stack, timeout=30))


@pytest.fixture(scope="module")
def small_pool(model_dir):
    """A decode pool of 32 pages (512 tokens) under a 4,096-token context: admission caps requests at the pool."""
    s = Stack(model_dir, decode_pool_tokens=512, allow_small=True)
    yield s
    s.close()


def test_a_dry_pool_preempts_the_youngest_and_every_stream_completes_through_resubmission(small_pool, oracle):
    s = small_pool
    prompts = [prompt(40, 950 + i) for i in range(3)]  # each needs 22 of the 32 pages by its end
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda p: s.generate(prompt_token_ids=p, max_tokens=300, ignore_eos=True), prompts))
    assert all("error" not in o for o in outs), [o.get("error") for o in outs]
    assert all(len(o["token_ids"]) == 300 for o in outs)
    preempted = s.metric("decode", "pdserve_preemptions_total")
    resubmitted = s.metric("gateway", "pdserve_resubmissions_total", {"outcome": "resubmitted"})
    assert preempted >= 1 and resubmitted == preempted, (preempted, resubmitted)
    # greedy: the resubmitted streams are the reference's tokens, none repeated, none missing
    oracle.check_many([(p, o["token_ids"]) for p, o in zip(prompts, outs)])
    assert s.metric("decode", "pdserve_lease_violations_total", {"reason": "GROWTH_REFUSED"}) == 0
    assert all(st.num_leased == 0 for st in wait_no_leases(s, timeout=30))
