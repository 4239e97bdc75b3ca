"""The broker replicas' leader election (services/broker/election.py) on real etcd servers: one leader with the key's
create revision as its term; a leader paused past its etcd lease (SIGSTOP) stops authorising before another is
elected and wakes knowing it lost; a resign hands over at once; a 3-member etcd cluster loses the member the
leader's client talks to and the election goes on. Every etcd and candidate process runs in its own process group
and is stopped by the test (SIGTERM), or by the kernel should the test process die (PR_SET_PDEATHSIG)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pdserve.broker.election import (Election, NotLeaderError, StaleTermError, connect, election_key, read_leader,
                                     txn_in_term)
from pdserve.common.etcd_server import EtcdCluster

TTL = 2
MARGIN = 0.5
CANDIDATE = Path(__file__).with_name("election_candidate.py")


@pytest.fixture
def etcd(tmp_path):
    """start(size) -> a running EtcdCluster, stopped (SIGTERM) after the test."""
    clusters = []

    def start(size: int = 1) -> EtcdCluster:
        c = EtcdCluster(tmp_path / f"etcd{len(clusters)}", size)
        clusters.append(c)
        c.start()
        return c
    yield start
    for c in clusters:
        c.stop()
        assert all(not m.is_running() for m in c.members)


def candidate(endpoints, key: bytes, identity: str, ttl: int = TTL) -> Election:
    return Election(connect(endpoints), key, identity, f"{identity}.local:50052", ttl=ttl, margin=MARGIN)


@contextlib.asynccontextmanager
async def a_leads_b_follows(endpoints, key: bytes, ttl: int = TTL, lead_within: float = 10):
    """Candidates a (started first, leading) and b (following it); both resigned and closed after."""
    a, b = candidate(endpoints, key, "a", ttl), candidate(endpoints, key, "b", ttl)
    try:
        a.start()
        await until(a.authorised, lead_within, "a leads")
        b.start()
        await until(lambda: b.state().leader is not None, 5, "b follows")
        yield a, b
    finally:
        for e in (a, b):
            await e.stop()
            await e.client.close()


async def until(pred, timeout: float, what: str) -> float:
    """Polls pred every 5 ms; returns the monotonic time it first held."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.005)
    return time.monotonic()


class Sampler:
    """Samples authorised() of every candidate every 5 ms; `overlaps()` lists the samples where two held it."""

    def __init__(self, elections: dict[str, Election]) -> None:
        self.elections, self.samples = elections, []
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.samples.append((time.monotonic(), {n: e.authorised() for n, e in self.elections.items()}))
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    def overlaps(self) -> list:
        return [(t, s) for t, s in self.samples if sum(s.values()) > 1]

    def intervals(self, name: str) -> list[tuple[float, float]]:
        out, start = [], None
        for t, s in self.samples:
            if s[name] and start is None:
                start = t
            elif not s[name] and start is not None:
                out.append((start, t))
                start = None
        if start is not None:
            out.append((start, self.samples[-1][0]))
        return out


def test_one_leader_its_term_the_key_create_revision(etcd):
    cluster = etcd(1)

    async def main():
        key = election_key("one")
        a, b = candidate(cluster.endpoints, key, "a"), candidate(cluster.endpoints, key, "b")
        a.start()
        b.start()
        try:
            await until(lambda: a.authorised() or b.authorised(), 5, "a leader")
            await until(lambda: a.state().leader and b.state().leader, 5, "both know the leader")
            leader, follower = (a, b) if a.authorised() else (b, a)
            assert not follower.authorised()
            got = await leader.client.get(key)
            term = leader.check()
            assert term == got.create_revision > 0
            assert json.loads(got.value) == {"identity": leader.identity, "address": leader.address}
            assert await read_leader(follower.client, key) == follower.state().leader
            assert follower.state().leader.identity == leader.identity and follower.state().leader.term == term
            assert follower.state().term == term and not follower.state().is_leader
            s = leader.state()
            assert s.is_leader and s.term == term and s.terms_won == 1 and 0 < s.authority_left_s <= TTL - MARGIN
            with pytest.raises(NotLeaderError, match=f"the leader is {leader.identity} .* term {term}"):
                follower.check()
            # a fenced write goes through under the term, and the inner compare decides as usual
            tx = leader.client.transactions
            ok, _ = await leader.fenced_txn(compare=[tx.version(b"/x") == 0], success=[tx.put(b"/x", b"1")])
            ok_again, _ = await leader.fenced_txn(compare=[tx.version(b"/x") == 0], success=[tx.put(b"/x", b"2")])
            assert (ok, ok_again) == (True, False) and (await leader.client.get(b"/x")).value == b"1"
            with pytest.raises(NotLeaderError):
                await follower.fenced_txn(success=[tx.put(b"/x", b"3")])
            assert (await leader.client.get(b"/x")).value == b"1"
        finally:
            for e in (a, b):
                await e.stop()
                await e.client.close()
    asyncio.run(main())


def _spawn_candidate(endpoints, key: bytes, identity: str):
    proc = subprocess.Popen([sys.executable, str(CANDIDATE), ",".join(endpoints), key.decode(), identity, str(TTL),
                             str(MARGIN)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True, preexec_fn=_die_with_parent, env=os.environ)
    lines: list[dict] = []
    threading.Thread(target=lambda: [lines.append(json.loads(x)) for x in proc.stdout], daemon=True).start()
    return proc, lines


def _die_with_parent():
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)


def test_a_paused_leader_stops_authorising_before_another_is_elected(etcd):
    cluster = etcd(1)
    key = election_key("pause")
    proc, lines = _spawn_candidate(cluster.endpoints, key, "paused")

    async def main():
        b = candidate(cluster.endpoints, key, "b")
        try:
            await until(lambda: lines and lines[-1]["authorised"], 10, "the child leads")
            old_term = lines[-1]["term"]
            b.start()
            await until(lambda: b.state().leader is not None, 5, "b follows")
            assert not b.authorised() and b.state().leader.term == old_term
            # paused after a keep-alive renewal, not only the lease grant that won the term
            await until(lambda: len({x["until"] for x in lines if x["authorised"]}) >= 2, 5, "a renewal")
            await asyncio.sleep(random.uniform(0, TTL / 3))
            stopped_at = time.monotonic()
            os.killpg(proc.pid, signal.SIGSTOP)
            won = await until(b.authorised, 5 * TTL, "b leads once the child's etcd lease expired")
            new_term = b.check()
            # paused longer than the ttl in all: etcd expired the lease a full ttl after the last renewal
            await asyncio.sleep(max(0.0, stopped_at + TTL + 0.5 - time.monotonic()))
            n_before = len(lines)
            continued_at = time.monotonic()
            os.killpg(proc.pid, signal.SIGCONT)
            await until(lambda: any(x.get("fenced") for x in lines[n_before:]), 5, "the child sees it lost")
            after = lines[n_before:]
            # its last authority ended before b's winning transaction was sent: never two authorised at once
            until_old = max(x["until"] for x in lines)  # the child never led another term
            assert until_old < b.state().term_since <= won, (until_old, b.state().term_since)
            print(f"paused leader's authority ended {b.state().term_since - until_old:.3f} s before the winning "
                  f"transaction was sent, {until_old - stopped_at:.3f} s after SIGSTOP")
            assert new_term > old_term
            # awake, it authorises nothing, from its very first look at the clock (one line may have read the
            # clock before the stop and been printed after)
            awake = [x for x in after if x["t"] >= continued_at]
            assert len(after) - len(awake) <= 1 and awake and not any(x["authorised"] for x in awake)
            lost = next(x for x in after if x.get("fenced"))
            assert lost["leader_term"] == new_term and lost["fenced"].startswith(f"NOT_LEADER: term {old_term} ended")
            # etcd itself refuses a write fenced by the old term, and applies one under the new
            tx = b.client.transactions
            with pytest.raises(StaleTermError, match=f"term {new_term} \\(b at"):
                await txn_in_term(b.client, key, old_term, success=[tx.put(b"/fenced", b"old")])
            assert await b.client.get(b"/fenced") is None
            assert (await b.fenced_txn(success=[tx.put(b"/fenced", b"new")]))[0]
            assert (await b.client.get(b"/fenced")).value == b"new"
            assert b.authorised() and (await read_leader(b.client, key)).term == new_term
        finally:
            await b.stop()
            await b.client.close()
    try:
        asyncio.run(main())
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(10) == 0


def test_resign_hands_over_at_once(etcd):
    cluster = etcd(1)
    ttl = 5  # a hand-over that waited for the lease to expire would take at least ttl - margin

    async def main():
        key = election_key("resign")
        async with a_leads_b_follows(cluster.endpoints, key, ttl, lead_within=5) as (a, b):
            old_term = a.check()
            sampler = Sampler({"a": a, "b": b})
            resigned = time.monotonic()
            await a.stop()
            assert not a.authorised()
            led = await until(b.authorised, ttl, "b leads after a resigned")
            await sampler.close()
            assert led - resigned < ttl / 2, led - resigned
            assert b.check() > old_term and sampler.overlaps() == []
            assert (await read_leader(b.client, key)).identity == "b"
    asyncio.run(main())


def test_a_dead_etcd_member_does_not_end_the_election(etcd):
    cluster = etcd(3)

    async def main():
        key = election_key("members")
        # the clients talk to the first endpoint (gRPC pick_first) and move to another when it goes away
        async with a_leads_b_follows(cluster.endpoints, key) as (a, b):
            term = a.check()
            talked_to = (await a.client.get(key)).header.member_id
            sampler = Sampler({"a": a, "b": b})
            cluster.members[0].signal(signal.SIGKILL)
            cluster.members[0].proc.wait(5)
            await asyncio.sleep(2 * TTL)
            await until(lambda: a.authorised() or b.authorised(), 5 * TTL, "a leader after the member died")
            await sampler.close()
            assert sampler.overlaps() == []
            leader = a if a.authorised() else b
            assert leader.check() >= term and (await read_leader(leader.client, key)).term == leader.check()
            # a's client talked to the member that died and now talks to another (pick_first stays put otherwise)
            assert (await a.client.get(key)).header.member_id != talked_to
            t0 = sampler.samples[0][0]
            spans = {n: [(round(x - t0, 2), round(y - t0, 2)) for x, y in sampler.intervals(n)] for n in "ab"}
            print(f"authorised after the kill (s): {spans}; term {term} -> {leader.check()} held by {leader.identity}")
    asyncio.run(main())


def test_etcd_quorum_lost_ends_the_authority_and_its_return_brings_a_leader_back(etcd):
    cluster = etcd(3)

    async def main():
        key = election_key("quorum")
        async with a_leads_b_follows(cluster.endpoints, key) as (a, b):
            term = a.check()
            sampler = Sampler({"a": a, "b": b})
            lost = time.monotonic()
            for m in cluster.members[1:]:
                m.signal(signal.SIGKILL)
                m.proc.wait(5)
            # an etcd leader cut off from its quorum renews leases from memory until raft's check-quorum steps it
            # down (within two election timeouts, 2 s); the last renewal it answered bounds a's authority
            ended = await until(lambda: not a.authorised(), 2.0 + TTL - MARGIN + 0.5, "a's authority ends")
            await asyncio.sleep(TTL)
            assert not a.authorised() and not b.authorised()
            with pytest.raises(NotLeaderError, match=f"NOT_LEADER: term {term} ended"):
                a.check()
            returned = time.monotonic()
            for m in cluster.members[1:]:
                cluster.restart(m)
            back = await until(lambda: a.authorised() or b.authorised(), 10 * TTL, "a leader once quorum is back")
            await sampler.close()
            assert sampler.overlaps() == []
            leader = a if a.authorised() else b
            assert leader.check() >= term and (await read_leader(leader.client, key)).term == leader.check()
            print(f"quorum lost: authority ended after {ended - lost:.2f} s; quorum back: {leader.identity} leads "
                  f"term {leader.check()} (was {term}) {back - returned:.2f} s after the restart")
    asyncio.run(main())


def test_the_election_runs_over_mutual_tls_and_a_client_without_a_certificate_is_refused(tmp_path):
    import grpc

    from pdserve.common.pki import make_pki
    files = make_pki(str(tmp_path / "pki"), ["operator/etcd", "broker/broker0", "broker/broker1"])
    server = files["operator/etcd"]  # any certificate of the CA naming 127.0.0.1 serves
    cluster = EtcdCluster(tmp_path / "etcd", 1, tls=(server.cert, server.key, server.ca))
    cluster.start()

    def credentials(identity: str):
        f = files[identity]
        return grpc.ssl_channel_credentials(*(Path(p).read_bytes() for p in (f.ca, f.key, f.cert)))

    async def main():
        key = election_key("tls")
        a = Election(connect(cluster.endpoints, credentials=credentials("broker/broker0")), key, "a", "a:1", TTL,
                     MARGIN)
        b = Election(connect(cluster.endpoints, credentials=credentials("broker/broker1")), key, "b", "b:1", TTL,
                     MARGIN)
        plain = connect(cluster.endpoints, timeout=1)
        try:
            a.start()
            await until(a.authorised, 10, "a leads over TLS")
            b.start()
            await until(lambda: b.state().leader is not None, 5, "b follows over TLS")
            assert b.state().leader.term == a.check()
            with pytest.raises(Exception):  # the client port demands a certificate
                await asyncio.wait_for(plain.get(key), 5)
        finally:
            for e in (a, b):
                await e.stop()
                await e.client.close()
            await plain.close()
    try:
        asyncio.run(main())
    finally:
        cluster.stop()


def test_a_member_restarted_from_a_thread_that_ends_stays_up(tmp_path):
    """The kernel's parent-death signal follows the thread that forked: the cluster forks from a thread of its own,
    so a member a short-lived worker restarts (a chaos schedule's thread pool) does not die with that worker."""
    cluster = EtcdCluster(tmp_path / "etcd", 1)
    cluster.start()
    try:
        m = cluster.members[0]
        m.signal(signal.SIGKILL)
        m.proc.wait(5)
        worker = threading.Thread(target=cluster.restart, args=(m,))
        worker.start()
        worker.join()
        deadline = time.monotonic() + 10
        while not m.is_healthy():
            assert m.is_running() and time.monotonic() < deadline, m.log_path.read_text()[-2000:]
            time.sleep(0.1)
        time.sleep(1.0)
        assert m.is_running() and m.is_healthy()
    finally:
        cluster.stop()
