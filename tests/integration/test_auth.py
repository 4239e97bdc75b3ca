"""Mutual TLS and per-method authorisation on the real stack (the default `stack` runs TLS, as `make run` does)."""
import os
import subprocess
import sys

import grpc
import pytest

from pdserve import launcher
from pdserve.common.errors import from_rpc_error
from pdserve.common.proto import broker_pb2 as pb, broker_pb2_grpc, common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from pdserve.common.tls import ENV, secure_channel
from tests.integration.helpers import prompt


def _served(stack, service: str, method: str) -> float:
    """How many calls of method the service's handlers ran (the latency histogram sits inside the auth check)."""
    try:
        return stack.metric(service, "pdserve_rpc_seconds_count", {"method": method})
    except KeyError:  # a histogram series appears with its first observation
        return 0.0


def _denials(stack, service: str, method: str, reason: str) -> float:
    return stack.metric(service, "pdserve_auth_denials_total", {"method": method, "reason": reason})


def _pool_id(stack) -> str:
    for line in stack.procs["decode"][0].lines:
        if " registered: " in line:
            return line.split("pool ", 1)[1].split(" ", 1)[0]
    raise AssertionError("decode never logged its pool id:\n" + stack.logs())


def _refused(call) -> object:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return from_rpc_error(e.value)


TARGETS = [("broker", "GetPoolState", lambda ch, pool: broker_pb2_grpc.BrokerStub(ch).GetPoolState(
               pb.GetPoolStateRequest(pool_id=pool), timeout=5)),
           ("prefill", "GetInfo", lambda ch, pool: prefill_pb2_grpc.PrefillStub(ch).GetInfo(
               common_pb2.GetInfoRequest(), timeout=5)),
           ("decode", "GetInfo", lambda ch, pool: decode_pb2_grpc.DecodeStub(ch).GetInfo(
               common_pb2.GetInfoRequest(), timeout=5))]


@pytest.mark.parametrize("service,method,call", TARGETS, ids=[t[0] for t in TARGETS])
def test_a_client_without_a_certificate_reaches_nothing(stack, service, method, call):
    target, pool = stack.procs[service][0].target, _pool_id(stack)
    served = _served(stack, service, method)
    no_cert = grpc.ssl_channel_credentials(root_certificates=stack.tls().ca)  # trusts the CA, shows no certificate
    for ch in (grpc.insecure_channel(target), grpc.secure_channel(target, no_cert)):
        with ch:
            err = _refused(lambda: call(ch, pool))
        assert err.code == grpc.StatusCode.UNAVAILABLE, err
    assert _served(stack, service, method) == served
    with secure_channel(target, stack.tls(), aio=False) as ch:  # the same call with the operator's certificate
        assert call(ch, pool) is not None
    assert _served(stack, service, method) == served + 1


def test_a_prefill_identity_cannot_grant_or_revoke(stack):
    pool = _pool_id(stack)
    before = stack.broker.GetPoolState(pb.GetPoolStateRequest(pool_id=pool), timeout=5)
    denied = {m: _denials(stack, "broker", m, "ROLE_NOT_ALLOWED") for m in ("Grant", "Revoke")}
    with secure_channel(stack.procs["broker"][0].target, stack.tls("prefill/prefill0"), aio=False) as ch:
        broker = broker_pb2_grpc.BrokerStub(ch)
        grant = _refused(lambda: broker.Grant(pb.GrantRequest(pool_id=pool, owner=b"g" * 16, num_pages=1,
                                                              epoch=before.epoch), timeout=5))
        revoke = _refused(lambda: broker.Revoke(pb.RevokeRequest(pool_id=pool, owner=b"g" * 16), timeout=5))
    for err, method in ((grant, "Grant"), (revoke, "Revoke")):
        assert (err.code, err.reason) == (grpc.StatusCode.PERMISSION_DENIED, "ROLE_NOT_ALLOWED"), err
        assert "prefill/prefill0" in err.message and method in err.message
        assert _denials(stack, "broker", method, "ROLE_NOT_ALLOWED") == denied[method] + 1
    after = stack.broker.GetPoolState(pb.GetPoolStateRequest(pool_id=pool), timeout=5)
    assert after.num_free + after.num_leased + after.num_quarantined == before.num_free + before.num_leased + \
        before.num_quarantined and after.num_leased <= before.num_leased


def test_a_decode_identity_cannot_begin_a_write(stack):
    pool = _pool_id(stack)
    denied = _denials(stack, "broker", "BeginWrite", "ROLE_NOT_ALLOWED")
    with secure_channel(stack.procs["broker"][0].target, stack.tls("decode/decode0"), aio=False) as ch:
        err = _refused(lambda: broker_pb2_grpc.BrokerStub(ch).BeginWrite(pb.BeginWriteRequest(
            pool_id=pool, owner=b"w" * 16, writer_id="decode/decode0/w"), timeout=5))
    assert (err.code, err.reason) == (grpc.StatusCode.PERMISSION_DENIED, "ROLE_NOT_ALLOWED"), err
    assert _denials(stack, "broker", "BeginWrite", "ROLE_NOT_ALLOWED") == denied + 1


def test_a_decode_identity_cannot_grant_on_another_decodes_pool(stack):
    pool = _pool_id(stack)
    assert pool.startswith("decode/decode0/"), pool
    state = stack.broker.GetPoolState(pb.GetPoolStateRequest(pool_id=pool), timeout=5)
    grants, denied = _served(stack, "broker", "Grant"), _denials(stack, "broker", "Grant", "NOT_OWN_RESOURCE")
    with secure_channel(stack.procs["broker"][0].target, stack.tls("decode/decode9"), aio=False) as ch:
        broker = broker_pb2_grpc.BrokerStub(ch)
        err = _refused(lambda: broker.Grant(pb.GrantRequest(pool_id=pool, owner=b"x" * 16, num_pages=1,
                                                            epoch=state.epoch), timeout=5))
        assert (err.code, err.reason) == (grpc.StatusCode.PERMISSION_DENIED, "NOT_OWN_RESOURCE"), err
        assert pool in err.message and "decode/decode9/" in err.message
        # nor renew it, nor watch it: a pool is its decode's alone
        ka = _refused(lambda: broker.KeepAlive(pb.KeepAliveRequest(holder_id=pool, ttl_ms=1), timeout=5))
        assert ka.reason == "NOT_OWN_RESOURCE", ka
    assert _denials(stack, "broker", "Grant", "NOT_OWN_RESOURCE") == denied + 1
    assert _served(stack, "broker", "Grant") == grants  # the handler never ran


def test_a_certificate_without_a_role_is_unauthenticated(stack):
    denied = _denials(stack, "prefill", "GetInfo", "BAD_PEER_IDENTITY")
    with secure_channel(stack.procs["prefill"][0].target, stack.tls("nobody"), aio=False) as ch:
        err = _refused(lambda: prefill_pb2_grpc.PrefillStub(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=5))
    assert (err.code, err.reason) == (grpc.StatusCode.UNAUTHENTICATED, "BAD_PEER_IDENTITY"), err
    assert _denials(stack, "prefill", "GetInfo", "BAD_PEER_IDENTITY") == denied + 1


def test_a_request_through_the_gateway_still_passes_the_oracle(stack, oracle):
    tokens = prompt(70, 909)
    out = stack.generate(prompt_token_ids=tokens, max_tokens=12, ignore_eos=True)
    assert "error" not in out, out
    assert len(out["token_ids"]) == 12
    oracle.check(tokens, out["token_ids"])


def _run_broker(*flags: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ENV.values()}
    return subprocess.run([sys.executable, "-m", "pdserve.cli", "broker", "--port", "0", "--metrics-port", "0",
                           *flags], capture_output=True, text=True, timeout=60, env={**env, **(env_extra or {})})


def test_a_service_without_certificates_refuses_to_start():
    r = _run_broker()
    assert r.returncode != 0 and "PDSERVE_READY" not in r.stdout
    assert "--tls-cert" in r.stderr and "--insecure" in r.stderr and "PDSERVE_TLS_CA" in r.stderr, r.stderr


def test_a_certificate_of_the_wrong_role_refuses_to_start(stack):
    t = stack.tls("decode/decode0")
    r = _run_broker("--tls-cert", t.cert_path, "--tls-key", t.key_path, "--tls-ca", t.ca_path)
    assert r.returncode != 0 and "decode/decode0" in r.stderr and "broker/NAME" in r.stderr, r.stderr


def test_insecure_is_an_explicit_loud_opt_in(tmp_path):
    proc = launcher.start("broker", ["broker", "--port", "0", "--metrics-port", "0", "--insecure",
                                     "--allow-unsafe", "insecure"], log_path=str(tmp_path / "broker.log"))
    try:
        assert any("ERROR" in line and "INSECURE MODE" in line and "NO AUTHORISATION" in line for line in proc.lines)
    finally:
        launcher.stop(proc)
