"""The gateway's concurrency limit: who it refuses, with which status, and the retry delay it estimates from how
fast admitted calls end."""
import asyncio

import grpc
import pytest

from pdserve.common.errors import PdError
from pdserve.common.metrics import OVERLOAD_REJECTIONS
from pdserve.gateway.limits import MAX_DELAY_S, MIN_DELAY_S, WINDOW_S, ConcurrencyLimit


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _enter(limit: ConcurrencyLimit, active: int) -> None:
    async def call():  # as generate() does: in the task of one gRPC call or HTTP choice
        limit.enter(active)
    asyncio.run(call())


def _refusal(limit: ConcurrencyLimit, active: int) -> PdError:
    with pytest.raises(PdError) as e:
        _enter(limit, active)
    return e.value


def test_refuses_only_past_the_limit_with_overloaded_and_counts_it():
    limit = ConcurrencyLimit(3)
    before = OVERLOAD_REJECTIONS.labels("gateway", "concurrency")._value.get()
    err = _refusal(limit, 4)
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.reason == "OVERLOADED"
    assert "3 requests are running" in err.message and "limit 3" in err.message
    assert err.retry_after_s == WINDOW_S  # nothing has ended yet: no slot is expected sooner than the window
    assert OVERLOAD_REJECTIONS.labels("gateway", "concurrency")._value.get() == before + 1
    for active in (1, 2, 3):
        _enter(limit, active)
    assert len(limit._ended) == 3  # admitted, and their calls ended; the refused one is not counted


def test_zero_means_no_limit_and_negative_is_refused():
    _enter(ConcurrencyLimit(0), 10**6)
    with pytest.raises(ValueError, match=">= 0"):
        ConcurrencyLimit(-1)


def test_retry_delay_is_calls_to_finish_over_the_recent_end_rate():
    clock = Clock()
    limit = ConcurrencyLimit(2, clock)
    clock.t += WINDOW_S  # a gateway up for a whole window
    for _ in range(20):  # 20 ends in the last 10 s: 2 per second
        limit._done(None)
    assert _refusal(limit, 3).retry_after_s == pytest.approx(0.5)  # one call must end
    assert _refusal(limit, 6).retry_after_s == pytest.approx(2.0)  # four must
    clock.t += WINDOW_S + 1  # those ends leave the window
    assert _refusal(limit, 3).retry_after_s == WINDOW_S
    for _ in range(1000):
        limit._done(None)
    assert _refusal(limit, 3).retry_after_s == MIN_DELAY_S
    assert _refusal(limit, 10**6).retry_after_s == MAX_DELAY_S


def test_young_gateway_measures_its_rate_since_start_up():
    clock = Clock()
    limit = ConcurrencyLimit(1, clock)
    clock.t += 2.0
    for _ in range(10):  # 10 ends in its first 2 s: 5 per second, not 1 (10 over the whole window)
        limit._done(None)
    assert _refusal(limit, 2).retry_after_s == pytest.approx(0.2)


def test_an_admitted_call_is_timed_to_its_task_end():
    clock = Clock()
    limit = ConcurrencyLimit(1, clock)

    async def call():
        limit.enter(1)
        await asyncio.sleep(0)

    async def main():
        task = asyncio.ensure_future(call())
        await asyncio.sleep(0)
        assert not limit._ended  # entered, not ended
        clock.t += 1.0
        await task
        await asyncio.sleep(0)  # done callbacks run on the next loop turn
    asyncio.run(main())
    assert list(limit._ended) == [1001.0]
