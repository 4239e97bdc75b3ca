"""WriteLeases.begin against a scripted broker: a refusal that says the broker lost the pool (it restarted, or a new
leader has not adopted it yet) is UNAVAILABLE, retryable, with no violation counted; one that says the lease is not
the request's is DATA_LOSS and counted; an answer of an older election term than one already seen is refused."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.common.errors import PdError
from pdserve.common.metrics import LEASE_VIOLATIONS
from pdserve.common.proto import broker_pb2
from pdserve.prefill.writelease import WriteLeases

OWNER = b"o" * 16


class Broker:
    def __init__(self, refuse: PdError | None = None, term: int = 0) -> None:
        self.refuse, self.term = refuse, term

    def BeginWrite(self, req, timeout=None):
        async def answer():
            if self.refuse is not None:
                raise self.refuse
            return broker_pb2.BeginWriteResponse(term=self.term)
        return answer()


def begin(broker, leases: WriteLeases | None = None):
    w = leases or WriteLeases(broker, "prefill/p0/1", 1.0)
    w.broker = broker
    return asyncio.run(w.begin("decode/d0/x", OWNER, 7, [], "prefill/p0/1/w"))


@pytest.mark.parametrize("reason", ["EPOCH_MISMATCH", "UNKNOWN_POOL", "POOL_FORGOTTEN", "POOL_EXPIRED"])
def test_a_pool_the_broker_lost_is_retryable_and_no_violation(reason):
    before = LEASE_VIOLATIONS.labels("prefill", "LEASE_NOT_CURRENT")._value.get()
    with pytest.raises(PdError) as e:
        begin(Broker(PdError(grpc.StatusCode.NOT_FOUND, reason, "gone")))
    assert (e.value.code, e.value.reason) == (grpc.StatusCode.UNAVAILABLE, reason)
    assert LEASE_VIOLATIONS.labels("prefill", "LEASE_NOT_CURRENT")._value.get() == before


def test_a_lease_not_the_requests_is_data_loss_and_counted():
    before = LEASE_VIOLATIONS.labels("prefill", "LEASE_NOT_CURRENT")._value.get()
    with pytest.raises(PdError) as e:
        begin(Broker(PdError(grpc.StatusCode.FAILED_PRECONDITION, "LEASE_NOT_CURRENT", "page 3 is FREE")))
    assert (e.value.code, e.value.reason) == (grpc.StatusCode.DATA_LOSS, "LEASE_NOT_CURRENT")
    assert LEASE_VIOLATIONS.labels("prefill", "LEASE_NOT_CURRENT")._value.get() == before + 1


def test_an_older_terms_authorisation_is_refused_before_any_post():
    w = WriteLeases(Broker(term=5), "prefill/p0/1", 1.0)
    w.terms.check(6, "KeepAlive")
    with pytest.raises(PdError) as e:
        begin(Broker(term=5), w)
    assert (e.value.code, e.value.reason) == (grpc.StatusCode.UNAVAILABLE, "OLD_TERM")
