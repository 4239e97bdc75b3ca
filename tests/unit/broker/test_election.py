"""services/broker/election.py without an etcd: arguments refused with the numbers, the etcd client's gRPC target for
one and for several endpoints, and a replica that never led refusing to authorise."""
from __future__ import annotations

import asyncio

import pytest

from pdserve.broker.election import Election, Leader, NotLeaderError, connect, election_key


def test_margin_and_ttl_are_checked():
    client = connect(["127.0.0.1:2379"])
    with pytest.raises(ValueError, match=r"margin must be in \(0, ttl=2\), got 2"):
        Election(client, b"/k", "a", "a:1", ttl=2, margin=2)
    with pytest.raises(ValueError, match=r"margin must be in \(0, ttl=2\), got 0"):
        Election(client, b"/k", "a", "a:1", ttl=2, margin=0)
    with pytest.raises(ValueError, match="ttl must be a whole number of seconds >= 1"):
        Election(client, b"/k", "a", "a:1", ttl=0, margin=0.5)


def test_several_endpoints_are_one_ipv4_target():
    one = connect(["etcd.example:2379"])
    assert (one._host, one._port) == ("etcd.example", 2379)
    three = connect(["127.0.0.1:2379", "127.0.0.2:22379", "127.0.0.3:32379"])
    assert f"{three._host}:{three._port}" == "ipv4:127.0.0.1:2379,127.0.0.2:22379,127.0.0.3:32379"
    with pytest.raises(ValueError, match="must be IPv4 address:port.*'etcd-1:2379'"):
        connect(["127.0.0.1:2379", "etcd-1:2379"])


def test_a_replica_that_never_led_refuses_with_who_leads():
    async def main():
        e = Election(connect(["127.0.0.1:1"]), election_key("c"), "b", "b:1", ttl=2, margin=0.5)
        assert not e.authorised() and not e.state().is_leader and e.state().authority_left_s == 0
        with pytest.raises(NotLeaderError, match="NOT_LEADER: b has not led; no other leader known"):
            e.check()
        e._observe(Leader("a", "a:1", 7))
        with pytest.raises(NotLeaderError, match="the leader is a at a:1, term 7"):
            e.check()
        with pytest.raises(NotLeaderError):
            await e.fenced_txn()
        assert e.state().term == 7 and not e.state().is_leader
    asyncio.run(main())


def test_unreadable_key_values_still_name_the_term():
    assert Leader.from_kv(b'{"identity": "a", "address": "x:1"}', 9) == Leader("a", "x:1", 9)
    assert Leader.from_kv(b"garbage", 9).term == 9 and "unreadable" in Leader.from_kv(b"garbage", 9).identity
