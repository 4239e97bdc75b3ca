"""Routing over several prefill and decode instances: load spreads, and every response is still correct."""
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration.helpers import prompt, wait_no_leases
from tests.integration.stack import Stack


@pytest.fixture(scope="module")
def wide(model_dir):
    s = Stack(model_dir, num_prefill=2, num_decode=2, prefill_pool_tokens=4096, decode_pool_tokens=4096)
    yield s
    s.close()


def test_requests_spread_over_two_prefills_and_two_decodes(wide, oracle):
    jobs = [prompt(20 + 37 * i, 500 + i) for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda p: wide.generate(prompt_token_ids=p, max_tokens=12, ignore_eos=True), jobs))
    for p, out in zip(jobs, outs):
        assert "error" not in out, out
        oracle.check(p, out["token_ids"])
    for svc in ("prefill", "decode"):
        served = [wide.metric(svc, "pdserve_rpc_seconds_count", {"method": "Prefill" if svc == "prefill" else "Decode"},
                              index=i) for i in range(2)]
        assert all(n >= 1 for n in served), (svc, served)
        assert sum(served) == 16
    states = wait_no_leases(wide)
    assert len(states) == 2 and all(s.num_leased == 0 for s in states)
