"""The one timing inequality, from the post (issue 18, hole 9): L = Mooncake timeout + 1 ns per byte of the largest
batch call + landing slack <= lock_delay. Prefill checks it at start-up in the whole milliseconds every BeginWrite
declares, and a refusal says it from the post with both numbers."""
import asyncio
import re

import pytest

from pdserve.broker.lease_table import LeaseError, LeaseTable
from pdserve.common.proto import broker_pb2
from pdserve.kvtransfer.engine import landing_bound_s
from pdserve.prefill.writelease import TimingBoundError, WriteLeases

POOL_BYTES = 16_777_216  # a prefill pool of 4096 tokens of the tiny model, 4096 bytes each


class FakeBroker:
    def __init__(self, lock_delay_ms: int):
        self.lock_delay_ms = lock_delay_ms

    def KeepAlive(self, request, timeout=None):
        async def answer():
            return broker_pb2.KeepAliveResponse(lock_delay_ms=self.lock_delay_ms)
        return answer()


def check(lock_delay_ms: int, slack_s: float) -> float:
    leases = WriteLeases(FakeBroker(lock_delay_ms), "prefill/p0/1", landing_bound_s(5, POOL_BYTES, slack_s))
    return asyncio.run(leases.check_bounds())


def test_the_bound_adds_timeout_bytes_and_slack():
    assert landing_bound_s(5, POOL_BYTES, 1.0) == pytest.approx(6.016777216)
    assert landing_bound_s(30, 4 << 30, 0.5) == pytest.approx(30 + 4.294967296 + 0.5)


def test_a_bound_that_fits_to_the_millisecond_passes_and_one_over_is_refused_with_both_numbers():
    assert check(6017, 1.0) == 6.017  # L = 6.0168 s rounds up to the 6017 ms a BeginWrite declares
    with pytest.raises(TimingBoundError) as e:
        check(6016, 1.0)
    msg = str(e.value)
    assert re.search(r"may land up to 6\.017s after it was posted \(.*\), but the broker may free its page 6\.016s "
                     r"after the writer's liveness expiry or a failed write's ack \(lock_delay\)", msg), msg
    assert "--lock-delay to at least 6.017" in msg and "call returned" not in msg, msg


def test_the_broker_refuses_a_begin_write_past_lock_delay_from_the_post():
    table = LeaseTable(lock_delay_s=2.0, default_writer_ttl_s=10.0, epoch=7, reader_ttl_s=float("inf"))
    table.register_pool("p", 4)
    owner = b"a" * 16
    leases = table.grant("p", owner, 1, 7)
    with pytest.raises(LeaseError) as e:
        table.begin_write("p", owner, 7, leases, "w", 2.001)
    assert e.value.reason == "LANDING_BOUND_EXCEEDS_LOCK_DELAY"
    assert "may land up to 2.001s after it was posted; the broker's lock_delay is 2.000s" in e.value.message
