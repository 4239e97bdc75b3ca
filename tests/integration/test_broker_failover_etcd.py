"""Broker replicas on a 3-member etcd under a real stack: a member dies while streams run and nothing a client sees
changes (same leader, same term, every stream complete); etcd loses its quorum and the leader stops answering
within its bound (running streams end typed and retryable, never with foreign tokens), and when the quorum returns
the service resumes without a restart, the pool handed over to the term that follows."""
from __future__ import annotations

import signal
import time

import pytest

from pdserve.common.etcd_server import EtcdCluster
from tests.integration.helpers import generate_when_served, prompt, wait_for
from tests.integration.stack import Stack
from tests.integration.test_broker_failover import (BROKER, DRAIN, MAX_BLIND, TTL, leader_and_standby, leading,
                                                    running_streams, scrape, served_again, value)


@pytest.fixture
def ha3(model_dir, tmp_path):
    etcd = EtcdCluster(tmp_path / "etcd", 3)
    etcd.start()
    stack = None
    try:
        stack = Stack(model_dir, brokers=2, etcd=",".join(etcd.endpoints),
                      extra={"broker": BROKER,
                             "prefill": ["--writer-ttl", "2.0", "--landing-slack", "0.3"],
                             "decode": ["--max-blind", str(MAX_BLIND), "--rpc-timeout", "3"]})
        yield stack, etcd
    finally:
        if stack is not None:
            stack.close()
        etcd.stop()


def test_an_etcd_member_dies_and_no_client_sees_a_change(ha3, oracle):
    stack, etcd = ha3
    lead, _ = leader_and_standby(stack)
    term = value(scrape(lead), "pdserve_broker_term")
    out = generate_when_served(stack, prompt(30, 81), 4)
    assert "error" not in out, out
    prompts, results, threads = running_streams(stack, 3, 800, 82)
    # the member every client's pick_first talks to: the first endpoint
    etcd.members[0].signal(signal.SIGKILL)
    for t in threads:
        t.join(120)
    for i, out in results.items():
        assert "error" not in out, (i, out, stack.logs()[-3000:])
        oracle.check(prompts[i], out["token_ids"])
    assert leading(lead) and value(scrape(lead), "pdserve_broker_term") == term
    assert stack.metric("decode", "pdserve_decode_handovers_total", {"outcome": "kept"}) == 0
    q = prompt(41, 83)
    out = stack.generate(prompt_token_ids=q, max_tokens=6, ignore_eos=True)
    assert "error" not in out, out
    oracle.check(q, out["token_ids"])


def test_lost_quorum_stops_the_leader_and_service_resumes_when_it_returns(ha3, oracle):
    stack, etcd = ha3
    lead, _ = leader_and_standby(stack)
    term = value(scrape(lead), "pdserve_broker_term")
    out = generate_when_served(stack, prompt(30, 91), 4)
    assert "error" not in out, out
    prompts, results, threads = running_streams(stack, 2, 3000, 92)
    for m in etcd.members[1:]:
        m.signal(signal.SIGKILL)
    lost = time.monotonic()
    # etcd's own leader keeps renewing leases until it notices it lost its quorum (CheckQuorum, one election
    # timeout: 1 s by default, plus scheduling); the broker's authority ends ttl - margin after the last renewal
    # it answered, and while there is no quorum no other leader can be elected at all
    wait_for(lambda: not leading(lead), TTL + 3, "the leader stops answering")
    assert time.monotonic() - lost <= 1.5 + TTL, f"authority lasted {time.monotonic() - lost:.2f}s after quorum loss"
    for t in threads:
        t.join(60)
    for i, out in results.items():  # ended typed and retryable, or complete: never wrong tokens
        if "error" in out:
            assert out["error"]["code"] == "UNAVAILABLE", out
        else:
            oracle.check(prompts[i], out["token_ids"])
    for m in etcd.members[1:]:
        etcd.restart(m)
    # the same term resumes when etcd kept the lease through the outage (it renews it at its election), a new
    # one follows when it expired: either way one replica answers again
    wait_for(lambda: sum(leading(p) for p in stack.procs["broker"]) == 1, 30, "a replica leads again")
    now = next(p for p in stack.procs["broker"] if leading(p))
    assert value(scrape(now), "pdserve_broker_term") >= term
    q = prompt(44, 93)
    # a lapse longer than the reader ttl fences the pool, and decode registers a new incarnation behind the fence
    out = served_again(stack, q, 6, DRAIN + 40)
    assert "error" not in out, (out, stack.logs()[-4000:])
    oracle.check(q, out["token_ids"])
    assert all(p.alive() for p in stack.procs["broker"])  # no restart
    assert stack.metric("decode", "pdserve_lease_violations_total") == 0
