"""Two decode pods of one Deployment, started the way the CPU overlay starts them (tests/deploy/pods.py: every
command line, probe and volume from the rendered manifests; each pod's csi volume is a certificate issued for
its own pod name by the CA behind the Issuer it names, as cert-manager's csi-driver would issue it). Pod A's
identity aimed at pod B's pool, the calls a shared role certificate let through (issue 18, hole 3): each is
refused PERMISSION_DENIED / NOT_OWN_RESOURCE, counted by the broker, and B's requests decode their own KV.

Not the whole overlay: the gateway finds decode pods through one headless Service name, and two pods cannot
sit behind one address on one machine, so the test drives prefill and decode itself, as the gateway does.
The pods' init containers are replaced by the checkpoint they make (test_launch_from_manifests checks that
they make the same bytes), and each pod listens on free ports of its own (pods.give_own_ports)."""
from __future__ import annotations

import os
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import pytest

from pdserve.common.errors import from_rpc_error
from pdserve.common.pki import issue
from pdserve.common.proto import broker_pb2 as pb, broker_pb2_grpc, decode_pb2_grpc, prefill_pb2_grpc
from pdserve.common.tls import TlsConfig, secure_channel
from tests.deploy.pods import LOOPBACK, LocalPod, give_own_ports, replica_names
from tests.deploy.render import by_kind, render
from tests.integration.helpers import allocate, collect, decode_stream, prefill, prompt

OWN = "NOT_OWN_RESOURCE"
FOREIGN_METHODS = ("WatchRevocations", "Release", "Grant", "KeepAlive")


def foreign_calls(broker, own_pool: str, pool: str, owner: bytes, epoch: int) -> dict:
    """What a decode identity can aim at another decode's pool, as one callable per method that returns once
    the broker answered: watch its revocations, release one of its owners, lease from it, and renew it as its
    reader while holding nothing there (the broker would then revoke its owners as lost)."""
    def watch():
        stream = broker.WatchRevocations(pb.WatchRevocationsRequest(pool_id=pool, epoch=epoch), timeout=10)
        try:
            return next(stream)
        finally:
            stream.cancel()
    return {
        "WatchRevocations": watch,
        "Release": lambda: broker.Release(pb.ReleaseRequest(pool_id=pool, owner=owner, epoch=epoch), timeout=10),
        "Grant": lambda: broker.Grant(pb.GrantRequest(pool_id=pool, owner=secrets.token_bytes(16), num_pages=1,
                                                      epoch=epoch), timeout=10),
        "KeepAlive": lambda: broker.KeepAlive(pb.KeepAliveRequest(holder_id=own_pool, ttl_ms=5000, pool_id=pool,
                                                                  held_owners=[]), timeout=10),
    }


def refusal(call):
    """The typed error of a call that must be refused; AssertionError when the broker served it."""
    try:
        served = call()
    except grpc.RpcError as e:
        return from_rpc_error(e)
    raise AssertionError(f"a call on another pod's pool was served: {served}")


def pool_id(pod: LocalPod) -> str:
    m = re.search(r"pool (\S+) registered:", pod.log(tail=1 << 30))
    assert m, f"{pod.pod_name} never logged its pool id:\n{pod.log()}"
    return m.group(1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir):
    objs = render("cpu")
    deps, services = by_kind(objs, "Deployment"), list(by_kind(objs, "Service"))
    root = tmp_path_factory.mktemp("instance-identity")
    issuers = {"pdserve-ca": str(root / "issuer")}
    a, b = replica_names(deps["pdserve-decode"], 2)
    pods = {"broker": LocalPod(deps["pdserve-broker"], str(root / "broker"), services, issuers=issuers),
            "prefill": LocalPod(deps["pdserve-prefill"], str(root / "prefill"), services, issuers=issuers),
            "a": LocalPod(deps["pdserve-decode"], str(root / "a"), services, pod_name=a, issuers=issuers),
            "b": LocalPod(deps["pdserve-decode"], str(root / "b"), services, pod_name=b, issuers=issuers)}
    for p in pods.values():
        give_own_ports(p)
        p.peers = {"pdserve-broker": pods["broker"]}
        if any(v["name"] == "models" for v in p.spec["volumes"]):
            os.symlink(model_dir, os.path.join(p.volume_dir("models"), "pdserve-tiny"))
    operator = issue(issuers["pdserve-ca"], "operator/test")
    channels = []

    def channel(pod: LocalPod, tls: TlsConfig):
        channels.append(secure_channel(f"{LOOPBACK}:{pod.port('grpc')}", tls, aio=False))
        return channels[-1]
    try:
        pods["broker"].start()
        pods["broker"].wait_started()
        for k in ("prefill", "a", "b"):  # side by side, as a kubelet starts them
            pods[k].start()
        for k in ("prefill", "a", "b"):
            pods[k].wait_started()
        tls = TlsConfig(operator.cert, operator.key, operator.ca)
        yield SimpleNamespace(
            pods=pods, channel=channel,
            broker=broker_pb2_grpc.BrokerStub(channel(pods["broker"], tls)),
            # what tests/integration/helpers drive, as the operator
            prefills=[prefill_pb2_grpc.PrefillStub(channel(pods["prefill"], tls))],
            decodes=[decode_pb2_grpc.DecodeStub(channel(pods[k], tls)) for k in ("a", "b")])
    finally:
        for ch in channels:
            ch.close()
        with ThreadPoolExecutor(3) as pool:  # each drains on its own, as the kubelet stops them
            list(pool.map(LocalPod.stop, (pods[k] for k in ("prefill", "a", "b"))))
        pods["broker"].stop()


def pod_tls(pod: LocalPod) -> TlsConfig:
    """The very files the pod's own process presents."""
    folder = pod.volume_dir("tls")
    return TlsConfig(*(os.path.join(folder, f) for f in ("tls.crt", "tls.key", "ca.crt")))


def request_on_b(cluster, num_prompt: int, max_tokens: int, seed: int):
    """A request prefilled into pod B's pool, its Decode not called yet, and pod A's broker stub:
    (pool_a, pool_b, tokens, rid, prefill's reply, as_a)."""
    pods = cluster.pods
    tokens = prompt(num_prompt, seed)
    rid, dest = allocate(cluster, len(tokens), max_tokens, d=1)
    resp = prefill(cluster, rid, tokens, dest, max_tokens)
    as_a = broker_pb2_grpc.BrokerStub(cluster.channel(pods["broker"], pod_tls(pods["a"])))
    return pool_id(pods["a"]), pool_id(pods["b"]), tokens, rid, resp, as_a


def test_each_pod_runs_as_its_own_pod_name(cluster):
    pods = cluster.pods
    for k in ("prefill", "a", "b"):
        role = pods[k].container["args"][0]
        assert f"mutual TLS as {role}/{pods[k].pod_name}" in pods[k].log(tail=1 << 30), pods[k].log()
    assert pods["a"].pod_name != pods["b"].pod_name
    assert pool_id(pods["a"]).startswith(f"decode/{pods['a'].pod_name}/")
    assert pool_id(pods["b"]).startswith(f"decode/{pods['b'].pod_name}/")


def test_pod_a_cannot_watch_release_grant_or_renew_pod_b_pool(cluster, oracle):
    pods, broker = cluster.pods, cluster.pods["broker"]
    # a request on B that waits for its Decode: its pages are leased and verified, nothing reads them yet
    pool_a, pool_b, tokens, rid, resp, as_a = request_on_b(cluster, 50, 12, 1801)
    before = cluster.broker.GetPoolState(pb.GetPoolStateRequest(pool_id=pool_b), timeout=5)
    assert before.num_leased > 0
    denied = {m: broker.metric("pdserve_auth_denials_total", {"method": m, "reason": OWN}) for m in FOREIGN_METHODS}
    errors = {m: refusal(call) for m, call in foreign_calls(as_a, pool_a, pool_b, rid, before.epoch).items()}
    for method, err in errors.items():
        assert (err.code, err.reason) == (grpc.StatusCode.PERMISSION_DENIED, OWN), (method, err)
        assert pool_b in err.message and f"decode/{pods['a'].pod_name}/" in err.message, (method, err.message)
        assert broker.metric("pdserve_auth_denials_total", {"method": method, "reason": OWN}) == denied[method] + 1
    after = cluster.broker.GetPoolState(pb.GetPoolStateRequest(pool_id=pool_b), timeout=5)
    assert (after.num_leased, after.num_free, after.num_quarantined) == \
        (before.num_leased, before.num_free, before.num_quarantined)
    # the same identity on its own pool is served: the refusals are about whose pool, not a broken certificate
    own = secrets.token_bytes(16)
    granted = as_a.Grant(pb.GrantRequest(pool_id=pool_a, owner=own, num_pages=1, epoch=before.epoch), timeout=10)
    assert len(granted.leases) == 1
    assert as_a.Release(pb.ReleaseRequest(pool_id=pool_a, owner=own, epoch=before.epoch), timeout=10).num_freed == 1
    # B's request decodes its own KV
    toks, err = collect(decode_stream(cluster, rid, tokens, resp, 12, d=1))
    assert err is None and len(toks) == 12, err
    oracle.check(tokens, toks)


def test_a_running_request_on_b_outlives_pod_a_releasing_it(cluster, oracle):
    pool_a, pool_b, tokens, rid, resp, as_a = request_on_b(cluster, 70, 200, 1802)
    stream = iter(decode_stream(cluster, rid, tokens, resp, 200, d=1))
    first = next(stream).token_id  # verified, validated, stepping
    epoch = cluster.broker.GetPoolState(pb.GetPoolStateRequest(pool_id=pool_b), timeout=5).epoch
    calls = foreign_calls(as_a, pool_a, pool_b, rid, epoch)
    for method in ("Release", "KeepAlive"):
        err = refusal(calls[method])
        assert (err.code, err.reason) == (grpc.StatusCode.PERMISSION_DENIED, OWN), (method, err)
    rest, err = collect(stream)
    assert err is None and len(rest) == 199, err
    oracle.check(tokens, [first, *rest])
