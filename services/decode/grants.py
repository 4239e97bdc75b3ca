"""A request's pages with the broker, from its Grant to its Release: the Grant (with the check of the cached pages
the broker shares, a bad one unpublished and the grant redone), the Publish of its full prompt pages, and the
release (its Publish awaited, the canary, the Release RPC). What each step means for the request's state goes
through the request table (requests.py); the RPCs themselves are lease.py's."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from ..common.deadline import timeout_within
from ..common.broker_client import replicas
from ..common.errors import PdError
from ..common.metrics import GUARD_SECONDS, PREFIX_LOOKUPS, PREFIX_REFUSED, count_violation
from ..common.tasks import spawn
from ..common.wire import leases_from_pb
from ..engine.kv_pool import KVPool
from . import faults
from .allocations import Allocation
from .growth import Growth
from .lease import LeaseClient
from .requests import RequestTable
from .reuse import PrefixPlan, first_bad_shared, shared_words
from .run import GrantQueue
from .verify import CANARY_BYTE

log = logging.getLogger(__name__)


class Grants:
    def __init__(self, pool: KVPool, requests: RequestTable, leases: LeaseClient, link, growth: Growth,
                 queue: GrantQueue, rpc_timeout_s: float, allocation_timeout_s: float,
                 allocation_timeout_per_token_s: float, check_checksums: bool, canary: bool):
        """link: the broker link (watch.BrokerWatch): the pool incarnation, whether decode is blind, and the event
        that asks it to re-register."""
        self.pool, self.requests, self.leases, self.link, self.growth, self.queue = (pool, requests, leases, link,
                                                                                     growth, queue)
        self.rpc_timeout_s = rpc_timeout_s
        self.allocation_timeout_s = allocation_timeout_s
        # prefill's write of a prompt takes longer the longer the prompt: its allocation waits this much more per token
        self.allocation_timeout_per_token_s = allocation_timeout_per_token_s
        self.check_checksums, self.canary = check_checksums, canary

    async def grant(self, owner: bytes, num_prompt_tokens: int, max_tokens: int, need: int,
                    deadline: float | None, plan: PrefixPlan | None = None) -> Allocation:
        """Leases `need` pages from the broker (RESOURCE_EXHAUSTED when the pool is short) as a new allocation. With
        a prefix plan, the leading pages the broker shares are checked here, before anything reads them; a bad one
        is reported and the grant redone without it and what follows (at most twice, then nothing is shared)."""
        lookup = plan.lookup[:need - 1] if plan is not None else []
        for attempt in range(3):
            resp, leases, pool_id = await self._grant_once(owner, need, deadline, lookup if attempt < 2 else [],
                                                           plan)
            k = resp.num_shared
            if k > len(lookup) or len(resp.shared_checksums) != k:
                self.requests.grant_refused(owner)
                spawn(self.release(owner, resp.epoch, leases))
                raise PdError(grpc.StatusCode.INTERNAL, "BAD_GRANT", f"the broker shared {k} cached pages with "
                                                                     f"{len(resp.shared_checksums)} checksums; "
                                                                     f"{len(lookup)} were looked up")
            bad = None
            if k:
                self.requests.share(owner, (p for p, _ in leases[:k]))
                faults.corrupt_cached(self.pool, owner, leases[:k], self.requests.readonly_of_others(owner))
                with GUARD_SECONDS.labels("prefix_check").time():
                    bad = first_bad_shared(self.pool, resp.epoch, leases[:k], lookup, list(resp.shared_checksums),
                                           self.check_checksums)
            if plan is not None and lookup:
                good = k if bad is None else bad[0]
                PREFIX_LOOKUPS.labels("hit").inc(good)
                PREFIX_LOOKUPS.labels("refused").inc(k - good)
                PREFIX_LOOKUPS.labels("miss").inc(len(lookup) - k)
            if bad is None:
                alloc = Allocation(resp.epoch, leases, num_prompt_tokens, max_tokens,
                                   time.monotonic() + self.allocation_timeout(num_prompt_tokens), pool_id,
                                   num_shared=k, shared_checksums=list(resp.shared_checksums), plan=plan)
                if k:
                    alloc.shared_words = shared_words(self.pool, leases[:k])
                return self.requests.granted(owner, alloc)
            i, reason, message = bad
            PREFIX_REFUSED.labels(reason).inc()
            log.warning("request %s: %s", owner.hex(), message)
            self.requests.grant_refused(owner)
            await asyncio.shield(self._unpublish_and_release(owner, resp.epoch, leases, leases[i:i + 1], reason))
            lookup = lookup[:i]
        raise AssertionError("unreachable: the last attempt shares nothing")

    async def _unpublish_and_release(self, owner: bytes, epoch: int, leases, bad, reason: str) -> None:
        """While still a reader of the bad page, take it out of the cache; then end this grant."""
        try:
            await self.leases.unpublish(owner, epoch, bad, reason)
        except PdError as e:  # it stays cached: the next reader's check refuses it again
            log.warning("Unpublish of %s failed: %s", bad, e)
        await self.release(owner, epoch, leases)

    async def _grant_once(self, owner: bytes, need: int, deadline: float | None, lookup: list[bytes],
                          plan: PrefixPlan | None, handed_over: bool = False):
        if (err := self.link.blind_error()) is not None:
            raise err
        if self.growth.blocks_new_grants():
            # running requests come first (growth.py): a new one waits in the queue until they have their pages
            raise PdError(grpc.StatusCode.RESOURCE_EXHAUSTED, "RUNNING_FIRST",
                          f"{len(self.growth.starving)} running requests wait for growth pages of pool "
                          f"{self.link.pool_id}")
        if self.requests.holds(owner):
            raise PdError(grpc.StatusCode.ALREADY_EXISTS, "OWNER_HAS_LEASE", f"request {owner.hex()} is already "
                                                                             f"allocated on pool {self.link.pool_id}")
        timeout = timeout_within(deadline, self.rpc_timeout_s, "before broker Grant")
        # held from before the Grant is sent: a KeepAlive racing the reply must not have it revoked
        self.requests.begin_grant(owner)
        pool_id = self.link.pool_id  # a move while the Grant is in flight must not relabel its leases
        rpc = asyncio.ensure_future(self.leases.grant(pool_id, owner, need, timeout, lookup,
                                                      plan.tag if plan is not None and lookup else b""))
        try:
            with GUARD_SECONDS.labels("grant_rpc").time():
                resp = await asyncio.shield(rpc)
        except asyncio.CancelledError:
            # the caller left while the Grant was in flight: once it answers, its leases go straight back
            rpc.add_done_callback(lambda t: self._abandoned_grant(owner, t))
            raise
        except PdError as e:
            self.requests.grant_failed(owner)
            if e.reason not in ("EPOCH_MISMATCH", "UNKNOWN_POOL", "POOL_FENCED"):
                raise
            self.link.epoch_changed.set()  # re-register now rather than at the next liveness tick
            if e.reason == "UNKNOWN_POOL" and not handed_over and replicas(self.leases.broker) > 1 \
                    and await self.link.handed_over(self.rpc_timeout_s) and self.link.pool_id == pool_id:
                # a new leader that had not adopted the pool yet: it has now, so the Grant goes again, once
                return await self._grant_once(owner, need, deadline, lookup, plan, handed_over=True)
            raise PdError(grpc.StatusCode.UNAVAILABLE, "BROKER_RESTARTED", e.message) from None
        leases = leases_from_pb(resp.leases)  # GRANTING until it is an allocation (or refused)
        if (err := self.leases.bad_grant(leases, need)) is not None:
            self.requests.grant_refused(owner)
            spawn(self.release(owner, resp.epoch, leases))
            raise err
        return resp, leases, pool_id

    def allocation_timeout(self, num_prompt_tokens: int) -> float:
        return self.allocation_timeout_s + num_prompt_tokens * self.allocation_timeout_per_token_s

    def _abandoned_grant(self, owner: bytes, rpc: asyncio.Future) -> None:
        if rpc.cancelled() or rpc.exception() is not None:
            self.requests.grant_failed(owner)
            return
        self.requests.grant_refused(owner)
        resp = rpc.result()
        leases = leases_from_pb(resp.leases)
        if resp.num_shared:
            self.requests.share(owner, (p for p, _ in leases[:resp.num_shared]))
        spawn(self.release(owner, resp.epoch, leases))

    async def publish(self, owner: bytes, alloc: Allocation, checksums: list[int]) -> None:
        """Offers the request's full prompt pages it did not get from the cache to later requests of its scope;
        a page the broker makes cached is read-only from now on (decode never writes a full prompt page)."""
        k, plan = alloc.num_shared, alloc.plan
        items = alloc.leases[k:plan.num_publishable]
        if not items:
            return
        try:
            ok = await self.leases.publish(alloc.pool_id, owner, alloc.epoch, items,
                                           plan.chains[k:plan.num_publishable],
                                           checksums[k:plan.num_publishable], plan.tag)
        except PdError as e:
            log.warning("Publish of %d pages of %s failed (they stay its own): %s", len(items), owner.hex(), e)
            return
        published = {p for (p, _), cached in zip(items, ok) if cached}
        if published:  # the owner's release forgets it only after this: never re-added
            self.requests.published(owner, published)

    async def release(self, owner: bytes, epoch: int, leases: list[tuple[int, int]]) -> None:
        """Gives an ended request's pages back: its Publish awaited, then (canary mode) the marker in every page of
        its own, then the Release. Refused for a request still held: the step loop ends it first."""
        if (publish := self.requests.publishing(owner)) is not None:
            # to its end (its call's own deadline bounds it): which pages are cached decides the canary, and a
            # Publish answered after this release must leave nothing behind for the owner
            await asyncio.wait([publish])
        if self.requests.holds(owner):
            # a step may still read or write these pages: the broker would free them at once. Stop the sequence
            # instead; the scheduler releases it between steps (defence in depth: every path that takes an
            # allocation hands it out once, so this is a bug elsewhere)
            count_violation("decode", "RELEASE_WHILE_HELD", owner)
            log.error("refused to release %s while the scheduler holds it; stopping it first", owner.hex())
            self.requests.fail(owner, PdError(grpc.StatusCode.INTERNAL, "RELEASE_WHILE_HELD",
                                              f"request {owner.hex()} was to be released while decoding"))
            return
        readonly = self.requests.forget(owner)  # cached pages others may read: never filled
        if self.canary:
            # before the broker can re-grant them: a page nobody rewrites keeps the marker, and a verified
            # page that still carries it would prove stale bytes got through
            self.pool.fill([p for p, _ in leases if p not in readonly], CANARY_BYTE)
        try:
            faults.fail_release(owner)
            with GUARD_SECONDS.labels("release_rpc").time():
                await self.leases.release(owner, epoch)
            self.queue.pages_may_be_free()
        except (grpc.RpcError, PdError) as e:
            # the broker restarting ends every lease of the old epoch anyway, and a live broker revokes an
            # owner this decode no longer lists as held
            log.warning("Release of %s failed: %s", owner.hex(), e)
