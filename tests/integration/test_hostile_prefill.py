"""Callers that are not our own code (issue 9, holes 6 and 7): a second Prefill of a lease decode already
validated, and a Prefill whose destination addresses point into another request's pages."""
import grpc
import pytest

from pdserve.common.errors import from_rpc_error
from pdserve.common.proto import common_pb2, decode_pb2
from tests.integration.helpers import allocate, collect, decode_stream, prefill, prompt

# a victim still running when the attack comes, with room to spare: decode does not wait for the client to read,
# and its native step runs ~1 ms a token here
VICTIM_TOKENS = 2000


def test_second_prefill_of_a_validated_lease_is_refused_and_the_first_stream_is_intact(stack, oracle):
    tokens = prompt(90, 61)
    # long enough to still hold its lease when the replay comes (decode does not wait for the client to read)
    rid, dest = allocate(stack, len(tokens), VICTIM_TOKENS)
    resp = prefill(stack, rid, tokens, dest, VICTIM_TOKENS)
    stream = iter(decode_stream(stack, rid, tokens, resp, VICTIM_TOKENS))
    first = [next(stream).token_id for _ in range(3)]  # decode has verified and validated the prompt pages
    replay = prompt(90, 62)  # other content: a replay that landed would change every later token
    before = stack.metric("prefill", "pdserve_lease_violations_total", {"reason": "LEASE_ALREADY_WRITTEN"})
    with pytest.raises(grpc.RpcError) as info:
        prefill(stack, rid, replay, dest, VICTIM_TOKENS)
    err = from_rpc_error(info.value)
    assert (err.code, err.reason) == (grpc.StatusCode.DATA_LOSS, "LEASE_ALREADY_WRITTEN"), err
    assert "written at most once" in err.message
    after = stack.metric("prefill", "pdserve_lease_violations_total", {"reason": "LEASE_ALREADY_WRITTEN"})
    assert after == before + 1
    rest, end = collect(stream)
    assert end is None, end
    assert len(first + rest) == VICTIM_TOKENS
    oracle.check(tokens, first + rest)


@pytest.mark.parametrize("aim", ["data_base", "tag_base", "transfer_session"])
def test_prefill_refuses_a_destination_that_differs_from_the_registered_pool(stack, oracle, aim):
    """With one valid lease, a caller aims the write at another request's pages: shifting data_base by the
    distance between the two requests' pages would land its KV there while every tag stays intact."""
    victim = prompt(70, 71)
    # long enough to still be running when the attack comes (decode does not wait for the client to read)
    vid, vdest = allocate(stack, len(victim), VICTIM_TOKENS)
    stream = iter(decode_stream(stack, vid, victim, prefill(stack, vid, victim, vdest, VICTIM_TOKENS), VICTIM_TOKENS))
    first = [next(stream).token_id for _ in range(2)]  # verified and running: its pages hold its own KV now
    attacker = prompt(70, 72)
    aid, adest = allocate(stack, len(attacker), 30)
    shift = vdest.leases[0].page - adest.leases[0].page  # never 0: both requests hold their pages now
    hostile = common_pb2.Destination()
    hostile.CopyFrom(adest)
    if aim == "data_base":
        hostile.data_base = adest.data_base + shift * adest.layout.page_nbytes
    elif aim == "tag_base":
        hostile.tag_base = adest.tag_base + shift * adest.layout.tag_nbytes
    else:
        hostile.transfer_session = "127.0.0.1:1"
    before = stack.metric("prefill", "pdserve_lease_violations_total", {"reason": "DESTINATION_MISMATCH"})
    with pytest.raises(grpc.RpcError) as info:
        prefill(stack, aid, attacker, hostile, 30)
    err = from_rpc_error(info.value)
    assert (err.code, err.reason) == (grpc.StatusCode.PERMISSION_DENIED, "DESTINATION_MISMATCH"), err
    assert f"{adest.data_base:#x}" in err.message  # the registered address, named for the operator
    assert stack.metric("prefill", "pdserve_lease_violations_total", {"reason": "DESTINATION_MISMATCH"}) == before + 1
    stack.decodes[0].Release(decode_pb2.DecodeReleaseRequest(request_id=aid), timeout=5)
    # the victim's pages never saw the attacker's bytes: its stream is computed from its own prompt alone
    rest, end = collect(stream)
    assert end is None and len(first + rest) == VICTIM_TOKENS, end
    oracle.check(victim, first + rest)
