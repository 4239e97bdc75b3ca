"""Callers that are not our own code, run in the middle of a chaos schedule (issue 9): a prefill identity
granting and revoking, a decode identity beginning a write, a Prefill aimed at another request's pages and a
replayed Prefill of a lease decode already validated. Every call must be refused with its typed reason; the
schedule's oracle and quiescence checks then show that nothing else changed."""
from __future__ import annotations

import time

import grpc

from pdserve.common.errors import from_rpc_error
from pdserve.common.proto import broker_pb2, broker_pb2_grpc, common_pb2, decode_pb2
from tests.integration.helpers import allocate, collect, decode_stream, prefill

REFUSED = {"PERMISSION_DENIED", "DATA_LOSS", "UNAVAILABLE", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION"}


def _refusal(call) -> tuple[str, str]:
    try:
        call()
    except grpc.RpcError as e:
        err = from_rpc_error(e)
        return err.code.name, err.reason
    raise AssertionError("a hostile call was served")


def _allocate(stack, n: int, max_tokens: int):
    """The schedule's own load may fill the pool for a moment: wait for room, as the gateway's queue would."""
    for _ in range(50):
        try:
            return allocate(stack, n, max_tokens)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            time.sleep(0.1)
    return allocate(stack, n, max_tokens)


def hostile_calls(stack, rng, owners: set[bytes]) -> list[tuple[str, str, str]]:
    """Returns (what, code, reason) per call; raises if any hostile call was served. owners: gets every request id
    the calls name, so that a violation counted for one is attributed to them (a true alarm the attack raised)."""
    pool_id = stack.pool_ids()[0]
    out = []
    evil_prefill = broker_pb2_grpc.BrokerStub(stack._ch(stack.procs["broker"][0].target, "prefill/evil"))
    evil_decode = broker_pb2_grpc.BrokerStub(stack._ch(stack.procs["broker"][0].target, "decode/evil"))
    owner = bytes(rng.randrange(256) for _ in range(16))
    owners.add(owner)
    out.append(("prefill identity Grant", *_refusal(lambda: evil_prefill.Grant(broker_pb2.GrantRequest(
        pool_id=pool_id, owner=owner, num_pages=1), timeout=10))))
    out.append(("prefill identity Revoke", *_refusal(lambda: evil_prefill.Revoke(broker_pb2.RevokeRequest(
        pool_id=pool_id, owner=owner, reason="EVIL"), timeout=10))))
    out.append(("decode identity BeginWrite", *_refusal(lambda: evil_decode.BeginWrite(broker_pb2.BeginWriteRequest(
        pool_id=pool_id, owner=owner, writer_id="decode/evil/w", max_landing_ms=1), timeout=10))))
    out.append(("decode identity Release on another pool", *_refusal(lambda: evil_decode.Release(
        broker_pb2.ReleaseRequest(pool_id=pool_id, owner=owner), timeout=10))))
    tokens = [rng.randrange(2, 512) for _ in range(40)]
    # a fresh lease aimed elsewhere: refused by prefill's destination check (BeginWrite then seals that lease, so
    # the replay below needs a second one)
    try:
        rid, dest = _allocate(stack, len(tokens), 60)
    except grpc.RpcError as e:  # a full pool or a restarting broker: the calls above still ran
        return out + [("allocate", from_rpc_error(e).code.name, "SKIPPED")]
    owners.add(rid)
    aimed = common_pb2.Destination()
    aimed.CopyFrom(dest)
    aimed.data_base += dest.layout.page_nbytes * rng.randrange(1, 8)
    out.append(("Prefill aimed elsewhere", *_refusal(lambda: prefill(stack, rid, tokens, aimed, 60))))
    stack.decodes[0].Release(decode_pb2.DecodeReleaseRequest(request_id=rid), timeout=10)
    try:
        # long enough that decode still holds the lease when the replay comes (it does not wait for the reader)
        rid, dest = _allocate(stack, len(tokens), 150)
        owners.add(rid)
        resp = prefill(stack, rid, tokens, dest, 150)
        stream = iter(decode_stream(stack, rid, tokens, resp, 150))
        next(stream)  # verified and validated by decode
    except grpc.RpcError as e:  # the request itself may fail under the schedule's faults: it is typed
        err = from_rpc_error(e)
        return out + [("replay setup", err.code.name, f"SKIPPED {err.reason}")]
    replay = [rng.randrange(2, 512) for _ in range(40)]
    out.append(("replayed Prefill", *_refusal(lambda: prefill(stack, rid, replay, dest, 150))))
    collect(stream)
    return out
