"""Decode's lease RPCs to the broker, all in one place: Grant, Extend, Validate (before the first step, and the
re-check after a revocation-stream outage), Publish, Unpublish and Release. Each builds its request for the pool
incarnation it is given or the link's current one, bounds it by the RPC timeout, and checks what the broker
answers where a wrong answer would put pages in doubt (all-or-nothing grants and growths): a reply that breaks
that is an INTERNAL error here, never passed on. What a call means for a request's state is the caller's.

The pool's own RPCs (RegisterPool, KeepAlive, WatchRevocations, GetPoolState) stay with the link (watch.py) and
the servicer: they are about the pool, not a request's leases."""
from __future__ import annotations

from typing import Protocol

import grpc

from ..common.errors import PdError
from ..common.proto import broker_pb2
from ..common.terms import Terms
from ..common.wire import call, leases_from_pb, leases_to_pb

Lease = tuple[int, int]


class Link(Protocol):
    """The pool incarnation the calls name, and the newest broker term seen (watch.BrokerWatch)."""
    pool_id: str
    epoch: int
    terms: Terms


class LeaseClient:
    def __init__(self, broker, link: Link, rpc_timeout_s: float):
        self.broker, self.link, self.rpc_timeout_s = broker, link, rpc_timeout_s

    async def grant(self, pool_id: str, owner: bytes, need: int, timeout: float, lookup: list[bytes],
                    scope_tag: bytes):
        """The Grant call, as an awaitable the caller may shield (a caller gone must not lose its reply)."""
        resp = await call(self.broker.Grant(broker_pb2.GrantRequest(
            pool_id=pool_id, owner=owner, num_pages=need, epoch=self.link.epoch, prefix_chains=lookup,
            scope_tag=scope_tag, term_seen=self.link.terms.newest), timeout=timeout), "broker Grant")
        self.link.terms.check(resp.term, "Grant")
        return resp

    @staticmethod
    def bad_grant(leases: list[Lease], need: int) -> PdError | None:
        """BAD_GRANT unless the Grant's reply holds all `need` pages (the caller releases what came)."""
        if len(leases) == need:
            return None
        # the broker grants all or nothing: anything else is a broker fault
        return PdError(grpc.StatusCode.INTERNAL, "BAD_GRANT", f"asked the broker for {need} pages, granted "
                                                              f"{len(leases)}")

    async def extend(self, items: list[tuple[bytes, int]]) -> list[list[Lease] | PdError]:
        """One Extend for many running sequences (growth.py): per item its new leases or the refusal."""
        resp = await call(self.broker.Extend(broker_pb2.ExtendRequest(
            pool_id=self.link.pool_id, epoch=self.link.epoch, owners=[o for o, _ in items],
            num_pages=[n for _, n in items], term_seen=self.link.terms.newest), timeout=self.rpc_timeout_s),
            "broker Extend")
        self.link.terms.check(resp.term, "Extend")
        epoch = self.link.epoch  # a move meanwhile makes the answer another epoch's: refused
        if len(resp.results) != len(items) or resp.epoch != epoch:
            raise PdError(grpc.StatusCode.INTERNAL, "BAD_EXTEND", f"asked the broker to grow {len(items)} sequences "
                                                                  f"in epoch {epoch:#x}; it answered "
                                                                  f"{len(resp.results)} results in epoch "
                                                                  f"{resp.epoch:#x}")
        out: list[list[Lease] | PdError] = []
        for (owner, n), r in zip(items, resp.results):
            if r.refused:
                out.append(PdError(grpc.StatusCode.FAILED_PRECONDITION, r.refused, r.message))
            elif len(r.leases) != n:  # all or nothing per item: anything else is a broker fault
                out.append(PdError(grpc.StatusCode.INTERNAL, "BAD_GRANT", f"asked for {n} growth pages for "
                                                                          f"{owner.hex()}, granted {len(r.leases)}"))
            else:
                out.append(leases_from_pb(r.leases))
        return out

    async def validate(self, owner: bytes, epoch: int, leases: list[Lease], timeout: float) -> None:
        """Before the first step: the prompt pages' leases are current and their writer is done."""
        resp = await call(self.broker.Validate(broker_pb2.ValidateRequest(
            pool_id=self.link.pool_id, owner=owner, epoch=epoch, leases=leases_to_pb(leases),
            term_seen=self.link.terms.newest), timeout=timeout), "broker Validate")
        self.link.terms.check(resp.term, "Validate")

    async def recheck(self, owner: bytes, epoch: int, leases: list[Lease]) -> None:
        """After a revocation-stream outage: exactly what the request holds, its own pages as LEASED to it and the
        cached ones with it among their readers (ValidateRequest.recheck)."""
        resp = await call(self.broker.Validate(broker_pb2.ValidateRequest(
            pool_id=self.link.pool_id, owner=owner, epoch=epoch, leases=leases_to_pb(leases), recheck=True,
            term_seen=self.link.terms.newest), timeout=self.rpc_timeout_s), "broker Validate")
        self.link.terms.check(resp.term, "Validate")

    async def publish(self, pool_id: str, owner: bytes, epoch: int, leases: list[Lease], chains: list[bytes],
                      checksums: list[int], scope_tag: bytes) -> list[bool]:
        """Offers full prompt pages to later requests of the scope; per page whether it is cached now."""
        resp = await call(self.broker.Publish(broker_pb2.PublishRequest(
            pool_id=pool_id, owner=owner, epoch=epoch, leases=leases_to_pb(leases), chains=chains,
            checksums=checksums, scope_tag=scope_tag), timeout=self.rpc_timeout_s), "broker Publish")
        return list(resp.published)

    async def unpublish(self, owner: bytes, epoch: int, leases: list[Lease], reason: str) -> None:
        """Takes pages that failed decode's check out of the cache (the caller still reads them)."""
        await call(self.broker.Unpublish(broker_pb2.UnpublishRequest(
            pool_id=self.link.pool_id, owner=owner, epoch=epoch, leases=leases_to_pb(leases), reason=reason),
            timeout=self.rpc_timeout_s), "broker Unpublish")

    async def release(self, owner: bytes, epoch: int) -> None:
        """Ends every lease of the owner; raises grpc.RpcError when the broker does not answer."""
        await self.broker.Release(broker_pb2.ReleaseRequest(pool_id=self.link.pool_id, owner=owner, epoch=epoch),
                                  timeout=self.rpc_timeout_s)


__all__ = ["LeaseClient"]
