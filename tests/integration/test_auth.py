"""Mutual TLS and per-method authorisation on the real stack (the default `stack` runs TLS, as `make run` does)."""
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

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
    no_cert = grpc.ssl_channel_credentials(root_certificates=stack.tls().ca)  # trusts the CA, shows no certificate
    # the broker's GetPoolState is also called by decode, at every GetInfo poll of the gateway (2 a second): a
    # refused call that got through would count in every attempt, a poll in the window only now and then
    leaked = []
    for _ in range(5):
        served = _served(stack, service, method)
        for ch in (grpc.insecure_channel(target), grpc.secure_channel(target, no_cert)):
            with ch:
                err = _refused(lambda: call(ch, pool))
            assert err.code == grpc.StatusCode.UNAVAILABLE, err
        leaked.append(_served(stack, service, method) - served)
        if leaked[-1] == 0:
            break
    assert leaked[-1] == 0, leaked
    served = _served(stack, service, method)
    with secure_channel(target, stack.tls(), aio=False) as ch:  # the same call with the operator's certificate
        assert call(ch, pool) is not None
    assert _served(stack, service, method) >= served + 1


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
    assert after.num_free + after.num_leased + after.num_quarantined + after.num_cached == before.num_free + \
        before.num_leased + before.num_quarantined + before.num_cached and after.num_leased <= before.num_leased


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


# --- every id-bearing field of a broker request is the caller's to name (issue 18, hole 4) ------------------------

REGION = pb.PoolRegion(transfer_session="127.0.0.1:9", data_base=0x1000, tag_base=0x2000)


class LoneBroker:
    """A second broker signed by the stack's CA, with bounds short enough that what a hostile call would do shows
    within seconds: reconcile grace 1 s, reader ttl 3 s, writer ttl 1 s, lock_delay 5 s (Mooncake's floor).
    Its pools are registered by a decode identity of the test's own; no real decode uses it."""

    def __init__(self, stack):
        self.stack = stack
        t = stack.tls("broker/broker1")
        self.proc = launcher.start("broker1", [
            "broker", "--port", "0", "--metrics-port", "0", "--tls-cert", t.cert_path, "--tls-key", t.key_path,
            "--tls-ca", t.ca_path, "--reconcile-grace", "1", "--reader-ttl", "3", "--writer-ttl", "1",
            "--lock-delay", "5", "--sweep-interval", "0.2"], log_path=os.path.join(stack.log_dir, "broker1.log"))
        self._channels = []

    def stub(self, identity: str):
        ch = secure_channel(self.proc.target, self.stack.tls(identity), aio=False)
        self._channels.append(ch)
        return broker_pb2_grpc.BrokerStub(ch)

    def metric(self, name: str, labels: dict) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.proc.metrics_port}/metrics", timeout=5).read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0  # a histogram series appears with its first observation

    def denials(self, method: str) -> float:
        return self.metric("pdserve_auth_denials_total", {"method": method, "reason": "NOT_OWN_RESOURCE"})

    def served(self, method: str) -> float:
        return self.metric("pdserve_rpc_seconds_count", {"method": method})

    def close(self) -> None:
        for ch in self._channels:
            ch.close()
        launcher.stop(self.proc)


@pytest.fixture(scope="module")
def lone(stack):
    broker = LoneBroker(stack)
    yield broker
    broker.close()


def _outcome(call):
    """The call's error, or None when it was accepted: the tests check the effects first, then the refusals."""
    try:
        call()
    except grpc.RpcError as e:
        return from_rpc_error(e)
    return None


def _assert_refused(err, *shown: str) -> None:
    assert err is not None, "the hostile call was accepted"
    assert (err.code, err.reason) == (grpc.StatusCode.PERMISSION_DENIED, "NOT_OWN_RESOURCE"), err
    assert all(s in err.message for s in shown), (shown, err.message)


def _register(decode, num_pages: int, **kw) -> tuple[str, int]:
    pool = f"decode/decode9/fake-{secrets.token_hex(4)}"
    return pool, decode.RegisterPool(pb.RegisterPoolRequest(pool_id=pool, num_pages=num_pages, region=REGION, **kw),
                                     timeout=5).epoch


def test_a_prefill_keepalive_neither_revokes_a_decodes_owners_nor_keeps_its_pool_alive(lone):
    d9, p0 = lone.stub("decode/decode9"), lone.stub("prefill/prefill0")
    pool, epoch = _register(d9, 8)
    owner = secrets.token_bytes(16)
    leases = d9.Grant(pb.GrantRequest(pool_id=pool, owner=owner, num_pages=3, epoch=epoch), timeout=5).leases
    time.sleep(1.2)  # past the reconcile grace: a KeepAlive of the pool that does not list the owner revokes it
    d9.KeepAlive(pb.KeepAliveRequest(holder_id=pool, ttl_ms=1000, pool_id=pool, held_owners=[owner]), timeout=5)
    served, denied = lone.served("KeepAlive"), lone.denials("KeepAlive")
    hostile = [_outcome(lambda: p0.KeepAlive(pb.KeepAliveRequest(holder_id="prefill/prefill0/h", ttl_ms=1000,
                                                                 pool_id=pool), timeout=5))]
    # renewed again by its decode: the pool cannot be fenced (READER_EXPIRED) before its state is read
    d9.KeepAlive(pb.KeepAliveRequest(holder_id=pool, ttl_ms=1000, pool_id=pool, held_owners=[owner]), timeout=5)
    state = d9.GetPoolState(pb.GetPoolStateRequest(pool_id=pool), timeout=5)
    assert (state.num_leased, state.num_quarantined) == (3, 0)  # NOT_HELD would have quarantined all three
    d9.Validate(pb.ValidateRequest(pool_id=pool, owner=owner, epoch=epoch, leases=leases), timeout=5)
    # its decode stops renewing the pool: fenced after the reader ttl, however often a prefill renews it
    deadline = time.monotonic() + 30
    while True:
        hostile.append(_outcome(lambda: p0.KeepAlive(pb.KeepAliveRequest(
            holder_id="prefill/prefill0/h", ttl_ms=1000, pool_id=pool, held_owners=[owner]), timeout=5)))
        # more pages than the pool has: takes nothing, and says whether the pool still accepts work
        probe = _outcome(lambda: d9.Grant(pb.GrantRequest(pool_id=pool, owner=b"p" * 16, num_pages=9, epoch=epoch),
                                          timeout=5))
        if probe.reason != "POOL_EXHAUSTED":
            break
        assert time.monotonic() < deadline, "a prefill's KeepAlives kept the decode's pool from being fenced"
        time.sleep(0.2)
    assert (probe.code, probe.reason) == (grpc.StatusCode.UNAVAILABLE, "POOL_FENCED"), probe
    for err in hostile:
        _assert_refused(err, "prefill/prefill0", "pool_id", repr(pool))
    assert lone.denials("KeepAlive") == denied + len(hostile)
    assert lone.served("KeepAlive") == served + 1  # decode9's own renewal; no hostile call reached the handler


def test_no_prefill_or_decode_renews_another_writer_or_the_brokers_own_holders(lone):
    """A renewed holder keeps the pages it holds in quarantine for as long as the caller likes."""
    d9, p0, p1 = lone.stub("decode/decode9"), lone.stub("prefill/prefill0"), lone.stub("prefill/prefill1")
    pool, epoch = _register(d9, 6, quarantined_pages=[0])  # held by earlier-epoch/<pool> for writer ttl + lock_delay
    failed, revoked, other = (secrets.token_bytes(16) for _ in range(3))
    leases = d9.Grant(pb.GrantRequest(pool_id=pool, owner=failed, num_pages=2, epoch=epoch), timeout=5).leases
    write = dict(pool_id=pool, owner=failed, epoch=epoch, leases=leases, writer_id="prefill/prefill0/w1")
    p0.BeginWrite(pb.BeginWriteRequest(**write, max_landing_ms=1000), timeout=5)
    p0.EndWrite(pb.EndWriteRequest(**write, success=False), timeout=5)  # held for lock_delay as failed/<writer>
    d9.Release(pb.ReleaseRequest(pool_id=pool, owner=failed, epoch=epoch), timeout=5)
    d9.Grant(pb.GrantRequest(pool_id=pool, owner=revoked, num_pages=1, epoch=epoch), timeout=5)
    lone.stub(launcher.OPERATOR).Revoke(pb.RevokeRequest(pool_id=pool, owner=revoked), timeout=5)
    leases = d9.Grant(pb.GrantRequest(pool_id=pool, owner=other, num_pages=1, epoch=epoch), timeout=5).leases
    p1.BeginWrite(pb.BeginWriteRequest(pool_id=pool, owner=other, epoch=epoch, leases=leases,
                                       writer_id="prefill/prefill1/w", max_landing_ms=1000, writer_ttl_ms=1000),
                  timeout=5)
    d9.Release(pb.ReleaseRequest(pool_id=pool, owner=other, epoch=epoch), timeout=5)  # prefill1 never acks
    assert d9.GetPoolState(pb.GetPoolStateRequest(pool_id=pool), timeout=5).num_quarantined == 5
    holders = [f"earlier-epoch/{pool}", "failed/prefill/prefill0/w1", f"revoked/{pool}/{revoked.hex()}",
               "prefill/prefill1/w"]
    denied, hostile = lone.denials("KeepAlive"), []
    deadline = time.monotonic() + 60
    while True:
        # its own reader, holding nothing and past every revocation: it acknowledges the revoked owner
        d9.KeepAlive(pb.KeepAliveRequest(holder_id=pool, ttl_ms=1000, pool_id=pool, revocations_seen=1 << 62),
                     timeout=5)
        hostile.append(_outcome(lambda: p0.KeepAlive(pb.KeepAliveRequest(
            holder_id="prefill/prefill0/h", ttl_ms=10_000, more_holder_ids=holders), timeout=5)))
        hostile.append(_outcome(lambda: d9.KeepAlive(pb.KeepAliveRequest(
            holder_id=pool, ttl_ms=10_000, pool_id=pool, more_holder_ids=holders), timeout=5)))
        state = d9.GetPoolState(pb.GetPoolStateRequest(pool_id=pool), timeout=5)
        if state.num_quarantined == 0:
            break
        assert time.monotonic() < deadline, f"pages never left quarantine: {state}"
        time.sleep(0.5)
    assert (state.num_free, state.num_writing) == (6, 0)
    for err in hostile:
        _assert_refused(err, "more_holder_ids", *map(repr, holders[:4]))
    assert lone.denials("KeepAlive") == denied + len(hostile)


def test_hostile_fields_against_the_real_stack_are_refused_and_it_keeps_serving(stack, oracle):
    """While a request streams: a prefill and another decode name the real decode's pool, owners with no pool of
    their own, another instance's holder and the broker's own holders."""
    pool = _pool_id(stack)
    owner = b"h" * 16
    holders = ["prefill/prefill1/1-ab/00", f"revoked/{pool}/{owner.hex()}", "failed/prefill/prefill0/1-ab/00",
               f"earlier-epoch/{pool}"]
    p0, d9 = "prefill/prefill0/h", "decode/decode9/x"
    hostile = {"prefill/prefill0": [
        (pb.KeepAliveRequest(holder_id=p0, pool_id=pool), "pool_id", repr(pool)),
        (pb.KeepAliveRequest(holder_id=p0, pool_id=pool, held_owners=[owner]), "pool_id", repr(pool)),
        (pb.KeepAliveRequest(holder_id=p0, held_owners=[owner]), "held_owners", owner.hex()),
        *[(pb.KeepAliveRequest(holder_id=p0, more_holder_ids=[h]), "more_holder_ids", repr(h)) for h in holders]],
        "decode/decode9": [
        (pb.KeepAliveRequest(holder_id=d9, pool_id=pool), "pool_id", repr(pool)),
        (pb.KeepAliveRequest(holder_id=d9, held_owners=[owner]), "held_owners", owner.hex()),
        *[(pb.KeepAliveRequest(holder_id=d9, more_holder_ids=[h]), "more_holder_ids", repr(h))
          for h in [pool, *holders]]]}
    tokens, out = prompt(70, 911), {}
    streaming = threading.Thread(target=lambda: out.update(stack.generate(prompt_token_ids=tokens, max_tokens=40,
                                                                          ignore_eos=True)))
    denied = _denials(stack, "broker", "KeepAlive", "NOT_OWN_RESOURCE")
    streaming.start()
    refusals = []
    for identity, calls in hostile.items():
        with secure_channel(stack.procs["broker"][0].target, stack.tls(identity), aio=False) as ch:
            broker = broker_pb2_grpc.BrokerStub(ch)
            for req, field, shown in calls:
                req.ttl_ms = 10_000
                refusals.append((_outcome(lambda: broker.KeepAlive(req, timeout=5)), identity, field, shown))
    streaming.join(120)
    assert "error" not in out and len(out.get("token_ids", ())) == 40, out
    oracle.check(tokens, out["token_ids"])  # the request kept its leases and its own KV throughout
    for err, identity, field, shown in refusals:
        _assert_refused(err, identity, field, shown)
    assert _denials(stack, "broker", "KeepAlive", "NOT_OWN_RESOURCE") == denied + len(refusals)
