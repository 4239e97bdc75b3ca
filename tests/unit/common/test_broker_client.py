"""services/common/broker_client.py with scripted stubs: calls go to one replica until it says it cannot answer
(NOT_LEADER, stopping, unreachable, silent); an answer of the leader's own, even UNAVAILABLE, keeps them there;
many calls failing together move on once; the revocation stream reports its failure too."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.common.broker_client import LeaderStub, addresses
from pdserve.common.errors import PdError, to_status


class Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, reason: str | None) -> None:
        self._code = code
        self._status = to_status(PdError(code, reason, "scripted")) if reason else None
        self._details = "scripted"

    def code(self):
        return self._code

    def details(self):
        return self._details

    def with_details(self, text: str) -> "Failed":
        self._details = text
        return self

    def trailing_metadata(self):
        return self._status.trailing_metadata if self._status else ()


class Replica:
    def __init__(self, name: str) -> None:
        self.name, self.fail, self.calls = name, None, 0

    def Grant(self, req, timeout=None):
        self.calls += 1

        async def answer():
            await asyncio.sleep(0)
            if self.fail is not None:
                raise self.fail
            return self.name
        return answer()

    def WatchRevocations(self, req):
        replica = self

        class Call:
            def cancel(self):
                return True

            async def __aiter__(self):
                yield replica.name
                if replica.fail is not None:
                    raise replica.fail
        return Call()


def stub():
    a, b, c = Replica("a"), Replica("b"), Replica("c")
    return LeaderStub(["a:1", "b:1", "c:1"], [a, b, c]), a, b, c


def test_addresses():
    assert addresses("a:1") == ["a:1"] and addresses(" a:1, b:2 ,") == ["a:1", "b:2"]
    with pytest.raises(ValueError, match="no broker address"):
        addresses(" , ")


@pytest.mark.parametrize("code,reason,moves", [
    (grpc.StatusCode.UNAVAILABLE, "NOT_LEADER", "retried"),  # refused before acting: sent on at once
    (grpc.StatusCode.UNAVAILABLE, "BROKER_STOPPING", "retried"),
    (grpc.StatusCode.UNAVAILABLE, None, "next"),  # connection refused: it may have acted, the call fails
    (grpc.StatusCode.DEADLINE_EXCEEDED, None, "next"),  # a paused replica
    (grpc.StatusCode.UNAVAILABLE, "POOL_FENCED", "stays"),  # the leader's own answer
    (grpc.StatusCode.FAILED_PRECONDITION, "LEASE_NOT_CURRENT", "stays"),
    (grpc.StatusCode.NOT_FOUND, "UNKNOWN_POOL", "stays")])
def test_which_failures_move_on(code, reason, moves):
    async def main():
        s, a, b, _ = stub()
        assert await s.Grant(None) == "a"
        a.fail = Failed(code, reason)
        if moves == "retried":
            assert await s.Grant(None) == "b" and a.calls == 2 and b.calls == 1
        else:
            with pytest.raises(grpc.RpcError):
                await s.Grant(None)  # the failed call fails: retrying is its caller's decision
            if moves == "next":
                assert await s.Grant(None) == "b"
            else:
                with pytest.raises(grpc.RpcError):
                    await s.Grant(None)
        assert (s.current, s.moves, b.calls > 0) == ((0, 0, False) if moves == "stays" else (1, 1, True))
    asyncio.run(main())


def test_calls_failing_together_move_on_once_and_a_refusal_everywhere_fails():
    async def main():
        s, a, b, c = stub()
        a.fail = Failed(grpc.StatusCode.UNAVAILABLE, None)
        results = await asyncio.gather(*(s.Grant(None) for _ in range(5)), return_exceptions=True)
        assert all(isinstance(r, grpc.RpcError) for r in results) and a.calls == 5
        assert s.current == 1 and s.moves == 1
        for r in (a, b, c):
            r.fail = Failed(grpc.StatusCode.UNAVAILABLE, "NOT_LEADER")
        with pytest.raises(grpc.RpcError):  # no replica leads: tried once each, then the refusal
            await s.Grant(None)
        assert (a.calls, b.calls, c.calls) == (6, 1, 1)
        a.fail = None
        assert await s.Grant(None) == "a"
    asyncio.run(main())


def test_a_failed_stream_moves_on():
    async def main():
        s, a, b, _ = stub()
        a.fail = Failed(grpc.StatusCode.UNAVAILABLE, "NOT_LEADER")
        got = []
        with pytest.raises(grpc.RpcError):
            async for msg in s.WatchRevocations(None):
                got.append(msg)
        assert got == ["a"] and s.current == 1
        got = [msg async for msg in s.WatchRevocations(None)]
        assert got == ["b"]
    asyncio.run(main())


def test_a_call_that_never_connected_is_sent_on():
    async def main():
        s, a, b, _ = stub()
        a.fail = Failed(grpc.StatusCode.UNAVAILABLE, None).with_details(
            "failed to connect to all addresses; last error: Connection refused")
        assert await s.Grant(None) == "b" and a.calls == 1 and s.current == 1
    asyncio.run(main())


def test_a_call_with_a_deadline_waits_out_an_election_and_never_past_its_deadline():
    async def main():
        s, a, b, c = stub()
        for r in (a, b, c):
            r.fail = Failed(grpc.StatusCode.UNAVAILABLE, "NOT_LEADER")
        a.fail = Failed(grpc.StatusCode.UNAVAILABLE, None).with_details(
            "failed to connect to all addresses; last error: Connection refused")  # the killed leader

        async def elect():
            await asyncio.sleep(0.3)
            c.fail = None
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        got, _ = await asyncio.gather(s.Grant(None, timeout=5), elect())
        assert got == "c" and 0.3 <= loop.time() - t0 < 1.5, loop.time() - t0
        assert a.calls >= 2 and b.calls >= 2  # refused round after round until one leads
        c.fail = Failed(grpc.StatusCode.UNAVAILABLE, "NOT_LEADER")
        t0 = loop.time()
        with pytest.raises(grpc.RpcError) as e:  # no one is elected: the refusal, by the call's deadline
            await s.Grant(None, timeout=0.5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and loop.time() - t0 < 0.7, loop.time() - t0
    asyncio.run(main())


def test_rounds_of_refusals_log_one_warning_until_a_replica_answers(caplog):
    async def main():
        s, a, b, c = stub()
        for r in (a, b, c):
            r.fail = Failed(grpc.StatusCode.UNAVAILABLE, "NOT_LEADER")

        async def elect():
            await asyncio.sleep(0.3)
            b.fail = None
        with caplog.at_level("WARNING", logger="pdserve.common.broker_client"):
            await asyncio.gather(s.Grant(None, timeout=5), elect())
            assert s.moves > 3 and len(caplog.records) == 1, caplog.records
            b.fail = Failed(grpc.StatusCode.UNAVAILABLE, "NOT_LEADER")
            await asyncio.gather(s.Grant(None, timeout=5), elect())  # answered since: its next move warns again
            assert len(caplog.records) == 2, caplog.records
    asyncio.run(main())
