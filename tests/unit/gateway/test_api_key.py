"""The gRPC API key check (issue 18, hole 7): exactly one `authorization: Bearer KEY` entry lets a call in."""
import pytest

from pdserve.gateway.api_key import OPEN
from pdserve.gateway.keys import ApiKeys

KEYS = ApiKeys.single("sk-1")


@pytest.mark.parametrize("metadata, ok", [
    ((("authorization", "Bearer sk-1"),), True),
    ((("user-agent", "grpc"), ("authorization", b"Bearer sk-1")), True),
    (None, False),
    ((), False),
    ((("authorization", "Bearer sk-2"),), False),
    ((("authorization", "Bearer sk-1x"),), False),
    ((("authorization", "Bearer sk-"),), False),
    ((("authorization", "sk-1"),), False),
    ((("authorization", "bearer sk-1"),), False),
    ((("x-api-key", "Bearer sk-1"),), False),
    # two entries: a proxy and this check could read different ones
    ((("authorization", "Bearer sk-1"), ("authorization", "Bearer sk-1")), False),
    ((("authorization", "Bearer sk-2"), ("authorization", "Bearer sk-1")), False),
])
def test_only_one_exact_bearer_entry_passes(metadata, ok):
    assert (KEYS.tenant_of_metadata(metadata) == "default") is ok
    assert (KEYS.tenant_of_metadata(metadata) is None) is not ok


def test_an_empty_key_is_refused_and_only_health_and_reflection_are_open():
    with pytest.raises(ValueError, match="empty API key"):
        ApiKeys.single("")
    assert all(not m.startswith("/pdserve.") for m in OPEN)
    assert "/grpc.health.v1.Health/" in OPEN
