"""The 2026 incident as tests: an over-long prompt is refused whole, and a short transfer never reaches a client.

The stack runs with a context (4096) larger than both pools (1024 tokens each), started with
--allow-pool-smaller-than-context, as the provider's deployment effectively was.
"""
import grpc
import pytest

from pdserve.common.errors import from_rpc_error
from pdserve.common.proto import common_pb2, prefill_pb2
from tests.integration.helpers import allocate, collect, decode_stream, prefill, prompt, drained, wait_for, wait_no_leases
from tests.integration.stack import Stack

POOL = 1024


@pytest.fixture(scope="module")
def small(model_dir):
    s = Stack(model_dir, prefill_pool_tokens=POOL, decode_pool_tokens=POOL, allow_small=True)
    yield s
    s.close()


def test_counters_exist_at_zero_from_startup(small):
    assert small.metric("decode", "pdserve_lease_violations_total", {"service": "decode", "reason": "CHECKSUM"}) == 0
    assert small.metric("decode", "pdserve_lease_violations_total", {"service": "decode"}) == 0
    assert small.metric("prefill", "pdserve_kv_transfer_bytes_total") == 0
    assert small.metric("prefill", "pdserve_kv_transfer_failures_total", {"stage": "data"}) == 0
    assert small.metric("gateway", "pdserve_requests_total", {"code": "OK"}) == 0
    assert small.metric("gateway", "pdserve_admission_rejections_total", {"reason": "PREFILL_POOL_EXCEEDED"}) == 0
    assert small.metric("broker", "pdserve_lease_violations_total", {"service": "broker"}) == 0
    # the shortfall the operator accepted is exported, for the alert
    assert small.metric("decode", "pdserve_kv_pool_context_ratio") == pytest.approx(POOL / 4096)
    assert small.metric("prefill", "pdserve_kv_pool_shortfall_tokens") == 4096 - POOL
    assert small.metric("broker", "pdserve_kv_pages", {"state": "free"}) == POOL // 16


def test_overlong_prompt_rejected_at_gateway_with_numbers_before_any_lease(small):
    grants = small.metric("broker", "pdserve_broker_grants_total")
    out = small.generate(prompt_token_ids=prompt(2000, 1), max_tokens=8)
    err = out["error"]
    assert err["code"] == "INVALID_ARGUMENT" and err["reason"] == "PREFILL_POOL_EXCEEDED"
    assert "2000" in err["message"] and str(POOL) in err["message"]
    assert out["token_ids"] == []
    assert small.metric("broker", "pdserve_broker_grants_total") == grants
    assert small.metric("gateway", "pdserve_admission_rejections_total", {"reason": "PREFILL_POOL_EXCEEDED"}) >= 1


def test_overlong_prompt_sent_straight_to_prefill_is_refused(small):
    info = small.prefills[0].GetInfo(common_pb2.GetInfoRequest(), timeout=5)
    tokens = prompt(2000, 2)
    dest = common_pb2.Destination(pool_id="nowhere", transfer_session="127.0.0.1:1", epoch=1, layout=info.layout,
                                  leases=[common_pb2.PageLease(page=i, generation=1) for i in range(125)])
    with pytest.raises(grpc.RpcError) as e:
        small.prefills[0].Prefill(prefill_pb2.PrefillRequest(
            request_id=b"\1" * 16, token_ids=tokens, sampling=common_pb2.SamplingParams(max_tokens=4),
            destination=dest), timeout=30)
    err = from_rpc_error(e.value)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.reason == "PREFILL_POOL_EXCEEDED"
    assert "2000" in err.message and str(POOL) in err.message
    assert small.metric("prefill", "pdserve_kv_transfer_bytes_total") == 0


def test_overlong_prompt_sent_straight_to_decode_is_refused(small):
    with pytest.raises(grpc.RpcError) as e:
        allocate(small, 2000, 8)
    err = from_rpc_error(e.value)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.reason == "DECODE_POOL_EXCEEDED"


def test_short_transfer_over_stale_pages_ends_in_data_loss_and_no_token(small, oracle):
    """Request A fills pages; B is granted the same pages, but prefill writes only B's first page and
    reports done: decode must find A's tags on the rest and refuse B before any token."""
    a_tokens = prompt(300, 3)
    rid_a, dest_a = allocate(small, 300, 5)
    resp = prefill(small, rid_a, a_tokens, dest_a, 5)
    toks_a, err = collect(decode_stream(small, rid_a, a_tokens, resp, 5))
    assert err is None
    oracle.check(a_tokens, toks_a)
    wait_no_leases(small)

    before = small.metric("decode", "pdserve_lease_violations_total", {"service": "decode"})
    small.arm("prefill", "prefill.short_transfer")
    out = small.generate(prompt_token_ids=prompt(300, 4), max_tokens=5, ignore_eos=True)
    assert out["error"]["code"] == "DATA_LOSS", out
    assert out["error"]["reason"] in ("TAG_OWNER", "TAG_GENERATION", "TAG_MISSING"), out
    assert out["token_ids"] == []
    assert small.metric("decode", "pdserve_lease_violations_total", {"service": "decode"}) == before + 1


def test_stale_page_left_unwritten_is_refused(small, oracle):
    """A fills pages and ends; B is granted the same physical pages with a new generation, and one of
    them is deliberately not written: decode refuses B."""
    # pages an earlier test's failures quarantined would leave quarantine between A and B, and B would get them
    wait_for(lambda: drained(small), 30, "an idle pool")
    a_tokens = prompt(250, 5)
    rid_a, dest_a = allocate(small, 250, 4)
    resp = prefill(small, rid_a, a_tokens, dest_a, 4)
    toks, err = collect(decode_stream(small, rid_a, a_tokens, resp, 4))
    assert err is None
    oracle.check(a_tokens, toks)
    wait_no_leases(small)

    b_tokens = prompt(250, 6)
    rid_b, dest_b = allocate(small, 250, 4)
    a_pages = {l.page: l.generation for l in dest_a.leases}
    b_pages = {l.page: l.generation for l in dest_b.leases}
    assert set(b_pages) == set(a_pages), "B must reuse A's physical pages for this test to mean anything"
    assert all(b_pages[p] > a_pages[p] for p in b_pages)
    small.arm("prefill", "prefill.skip_page", arg="7")
    resp = prefill(small, rid_b, b_tokens, dest_b, 4)
    assert resp.coverage.num_tokens == 250  # prefill claims full coverage, as in the incident
    toks, err = collect(decode_stream(small, rid_b, b_tokens, resp, 4))
    assert toks == []
    assert err.code == grpc.StatusCode.DATA_LOSS and err.reason in ("TAG_OWNER", "TAG_GENERATION")
    assert "page 7" in err.message


def test_bit_flip_in_transfer_is_caught_by_checksum(small):
    small.arm("prefill", "prefill.bit_flip", arg="2")
    out = small.generate(prompt_token_ids=prompt(100, 7), max_tokens=5, ignore_eos=True)
    assert out["error"]["code"] == "DATA_LOSS" and out["error"]["reason"] == "CHECKSUM", out
    assert out["token_ids"] == []


def test_lost_tag_writes_are_caught(small):
    small.arm("prefill", "prefill.skip_tags")
    out = small.generate(prompt_token_ids=prompt(40, 8), max_tokens=5, ignore_eos=True)
    assert out["error"]["code"] == "DATA_LOSS", out
    assert out["token_ids"] == []


def test_no_page_leaked(small):
    small.clear_faults()
    for s in wait_no_leases(small):
        assert s.num_leased == 0
        assert s.num_free + s.num_quarantined + s.num_cached == s.num_pages
