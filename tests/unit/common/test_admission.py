"""Admission rules (DESIGN §4): every rejection is INVALID_ARGUMENT with a reason and the numbers."""
import math

import grpc
import pytest
from prometheus_client import REGISTRY

from pdserve.common.admission import check_lengths, check_sampling, check_tokens
from pdserve.common.config import pages_for, pages_needed
from pdserve.common.errors import PdError


def _count(reason):
    return REGISTRY.get_sample_value("pdserve_admission_rejections_total", {"reason": reason}) or 0.0


def _rejected(fn, *args, reason, numbers=()):
    before = _count(reason)
    with pytest.raises(PdError) as e:
        fn(*args)
    err = e.value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.reason == reason
    for n in numbers:
        assert str(n) in err.message, (n, err.message)
    assert _count(reason) == before + 1
    return err


def test_pages_for_and_pages_needed():
    assert [pages_for(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    # the last generated token is never fed back, so it takes no KV slot
    assert pages_needed(16, 1, 16) == 1
    assert pages_needed(16, 2, 16) == 2
    assert pages_needed(10, 7, 16) == 1
    assert pages_needed(10, 8, 16) == 2
    assert pages_needed(1, 1, 4) == 1


def test_empty_prompt():
    _rejected(check_tokens, [], 512, reason="EMPTY_PROMPT", numbers=[0])


def test_token_out_of_vocab():
    err = _rejected(check_tokens, [1, 512, 3, 700], 512, reason="TOKEN_OUT_OF_VOCAB", numbers=[2, 512, "first 512"])
    assert "2 prompt token ids" in err.message


def test_negative_token():
    _rejected(check_tokens, [5, -1], 512, reason="TOKEN_OUT_OF_VOCAB", numbers=["first -1"])


def test_tokens_in_range_pass():
    check_tokens([0, 511, 256], 512)


@pytest.mark.parametrize("max_tokens", [0, -3])
def test_bad_max_tokens(max_tokens):
    _rejected(check_sampling, max_tokens, 0.0, 1.0, reason="BAD_MAX_TOKENS", numbers=[max_tokens])


@pytest.mark.parametrize("temperature", [-0.5, math.nan, math.inf])
def test_bad_temperature(temperature):
    _rejected(check_sampling, 4, temperature, 1.0, reason="BAD_TEMPERATURE", numbers=[temperature])


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.5, math.nan])
def test_bad_top_p(top_p):
    _rejected(check_sampling, 4, 0.7, top_p, reason="BAD_TOP_P", numbers=[top_p])


def test_sampling_boundaries_pass():
    check_sampling(1, 0.0, 1.0)
    check_sampling(1, 2.0, 1e-9)


def test_context_exceeded():
    _rejected(check_lengths, 100, 29, 128, 16, None, None, reason="CONTEXT_EXCEEDED", numbers=[100, 29, 129, 128])


def test_context_boundary_passes():
    check_lengths(100, 28, 128, 16, None, None)
    check_lengths(127, 1, 128, 16, 8, 128)


def test_prefill_pool_exceeded():
    _rejected(check_lengths, 65, 1, 4096, 16, None, 64, reason="PREFILL_POOL_EXCEEDED", numbers=[65, 64])


def test_prefill_pool_boundary_passes():
    check_lengths(64, 1, 4096, 16, None, 64)


def test_decode_pool_exceeded():
    # 60 + 6 - 1 = 65 slots = 5 pages of 16; the pool has 4 (64 tokens)
    _rejected(check_lengths, 60, 6, 4096, 16, 4, None, reason="DECODE_POOL_EXCEEDED", numbers=[60, 6, "5 pages", 16,
                                                                                               "4 pages", 64])


def test_exactly_the_decode_pools_pages_passes():
    # 60 + 5 - 1 = 64 slots = exactly 4 pages
    assert pages_needed(60, 5, 16) == 4
    check_lengths(60, 5, 4096, 16, 4, None)
    assert pages_needed(64, 1, 16) == 4
    check_lengths(64, 1, 4096, 16, 4, None)


def test_context_checked_before_pools():
    _rejected(check_lengths, 200, 100, 256, 16, 1, 10, reason="CONTEXT_EXCEEDED", numbers=[300, 256])


def test_no_pool_limits_means_only_context():
    check_lengths(4000, 96, 4096, 16, None, None)
