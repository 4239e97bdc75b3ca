"""The Broker stub of prefill and decode. One address: the plain stub. Several (the replicas of an elected broker,
docs/design.md §3, "Leader failover"): a stub that follows the leader. A call is sent to the replica believed to
lead; when it fails in a way that says this replica cannot answer (it does not lead, it is stopping, it is
unreachable or silent), the next calls go to the next replica. A call a replica *refused* as not leading or
stopping, or one that could not even connect, is sent on to the next one at once: the refusal comes before the
replica's table acts, and a call never connected was never sent, so nothing happened; when every replica refuses
(an election under way), the call tries them again until its own deadline. Any other failed call still fails:
whether to retry is its caller's decision (a Grant is not idempotent, and an unreachable replica may have acted),
exactly as with one broker that restarted."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from .errors import from_rpc_error
from .proto import broker_pb2_grpc
from .tls import TlsConfig, secure_channel

log = logging.getLogger(__name__)

# answered by a replica that cannot serve: look for the leader elsewhere
_MOVE_ON = {"NOT_LEADER", "BROKER_STOPPING"}
_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
# gRPC's words for a call that found no connection to the replica: nothing of it was sent
_NEVER_SENT = "failed to connect to all addresses"
# between rounds of refusals, while a replica is being elected
_FIRST_PAUSE_S, _LAST_PAUSE_S = 0.05, 0.4


def addresses(text: str) -> list[str]:
    """`--broker` as a list: one address, or the replicas' addresses joined by commas."""
    out = [a.strip() for a in text.split(",") if a.strip()]
    if not out:
        raise ValueError(f"no broker address in {text!r}")
    return out


def broker_stub(text: str, tls: TlsConfig | None, options) -> object:
    """A Broker stub over the address(es) in `text` (--broker)."""
    targets = addresses(text)
    stubs = [broker_pb2_grpc.BrokerStub(secure_channel(t, tls, options)) for t in targets]
    return stubs[0] if len(stubs) == 1 else LeaderStub(targets, stubs)


def replicas(stub) -> int:
    """How many broker replicas a stub made by broker_stub reaches."""
    return len(stub.stubs) if isinstance(stub, LeaderStub) else 1


class LeaderStub:
    """Calls go to `stubs[current]`; a failure that says that replica cannot answer moves `current` on."""

    def __init__(self, targets: list[str], stubs: list) -> None:
        self.targets, self.stubs = targets, stubs
        self.current = 0
        self.moves = 0
        self._answered = True  # since the last move: an election's rounds of refusals log one warning, not each

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        if method == "WatchRevocations":
            return lambda *a, **kw: _Stream(self, self.current, self.stubs[self.current].WatchRevocations(*a, **kw))

        async def unary(*args, timeout: float | None = None, **kwargs):
            # every replica refusing without acting is an election under way: with a deadline, the call waits it
            # out by rounds, never past its deadline; without one it fails after one round
            deadline = None if timeout is None else time.monotonic() + timeout
            pause, refusal = _FIRST_PAUSE_S, None
            while True:
                for _ in range(len(self.stubs)):
                    i = self.current
                    left = None if deadline is None else deadline - time.monotonic()
                    if refusal is not None and left is not None and left <= 0:
                        raise refusal
                    try:
                        answer = await getattr(self.stubs[i], method)(*args, timeout=left, **kwargs)
                        self._answered = True
                        return answer
                    except grpc.RpcError as e:
                        if not self.failed(i, e):
                            raise
                        refusal = e
                if deadline is None or deadline - time.monotonic() <= pause:
                    raise refusal
                await asyncio.sleep(pause)
                pause = min(2 * pause, _LAST_PAUSE_S)
        return unary

    def failed(self, i: int, e: grpc.RpcError) -> bool:
        """Moves on from replica i once, however many calls to it fail together; returns whether the replica
        refused the call without acting on it (NOT_LEADER, BROKER_STOPPING)."""
        code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
        if code not in _UNREACHABLE:
            return False
        reason = from_rpc_error(e).reason
        # UNAVAILABLE with a reason of the leader's own (FAULT_..., POOL_...) is an answer, not a replica gone
        if code == grpc.StatusCode.UNAVAILABLE and reason not in _MOVE_ON and reason != "UNKNOWN":
            return False
        # a replica that refused before its table acted, or one never connected to: the call was not acted on
        details = (e.details() if hasattr(e, "details") else None) or ""
        refused = code == grpc.StatusCode.UNAVAILABLE and (reason in _MOVE_ON or _NEVER_SENT in details)
        if i != self.current:
            return refused
        self.current = (i + 1) % len(self.stubs)
        self.moves += 1
        log.log(logging.WARNING if self._answered else logging.DEBUG, "broker replica %s cannot answer (%s %s); "
                "trying %s", self.targets[i], code.name, reason, self.targets[self.current])
        self._answered = False
        return refused


class _Stream:
    """A WatchRevocations call that reports its failure to the LeaderStub; iterate it, or cancel it."""

    def __init__(self, owner: LeaderStub, i: int, call) -> None:
        self._owner, self._i, self._call = owner, i, call

    def cancel(self) -> bool:
        return self._call.cancel()

    async def __aiter__(self):
        try:
            async for msg in self._call:
                yield msg
        except grpc.RpcError as e:
            self._owner.failed(self._i, e)
            raise
