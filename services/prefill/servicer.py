"""Prefill gRPC servicer: re-checks admission, BeginWrite, forward, transfer, EndWrite in every outcome."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from ..common.admission import check_sampling, check_tokens
from ..common.config import pages_for
from ..common.errors import PdError, invalid
from ..common.faults import FAULTS
from ..common.metrics import (GUARD_SECONDS, LEASE_VIOLATIONS, TIMEOUTS, TRANSFER_BYTES, TRANSFER_FAILURES,
                              TRANSFER_SECONDS)
from ..common.proto import broker_pb2, common_pb2, prefill_pb2, prefill_pb2_grpc
from ..common.tasks import spawn
from ..common.wire import call, layout_to_pb, leases_from_pb, leases_to_pb, sampling_from_pb
from ..engine.tags import TAG_NBYTES
from ..kvtransfer.engine import TransferError
from .worker import PrefillWorker, Target

log = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker, broker, writer_id: str, context_length: int, max_prompt: int,
                 model_name: str, rpc_timeout_s: float = 10.0, writer_ttl_s: float = 5.0,
                 transfer_timeout_s: float = 30.0, liveness_margin_s: float = 1.0):
        if liveness_margin_s >= writer_ttl_s:
            raise ValueError(f"liveness margin {liveness_margin_s}s must be under the writer ttl {writer_ttl_s}s")
        self.writer_ttl_s = writer_ttl_s
        self.transfer_timeout_s = transfer_timeout_s
        self.liveness_margin_s = liveness_margin_s
        self.worker = worker
        self.broker = broker
        self.writer_id = writer_id
        self.context_length = context_length
        self.max_prompt = max_prompt  # capped by the local pool
        self.model_name = model_name
        self.rpc_timeout_s = rpc_timeout_s
        self._compute = asyncio.Lock()
        self._pages_freed = asyncio.Condition()
        self.layout_pb = layout_to_pb(worker.pool.layout, TAG_NBYTES)

    async def GetInfo(self, request, context) -> common_pb2.EngineInfo:
        cfg = self.worker.runner.config
        return common_pb2.EngineInfo(
            model=self.model_name, context_length=self.context_length, vocab_size=cfg.vocab_size,
            pool_pages=self.worker.pool.num_pages, page_size=self.worker.pool.page_size,
            eos_token_id=cfg.eos_token_id if cfg.eos_token_id is not None else -1,
            layout=self.layout_pb, free_pages=self.worker.alloc.num_free)

    def _admit(self, request) -> Target:
        tokens = request.token_ids
        check_tokens(tokens, self.worker.runner.config.vocab_size)
        check_sampling(request.sampling.max_tokens or 1, request.sampling.temperature, request.sampling.top_p or 1.0)
        n = len(tokens)
        if n > self.max_prompt:
            # never a placeholder: a prompt that does not fit is refused whole (the incident)
            raise invalid("PREFILL_POOL_EXCEEDED", f"prompt is {n} tokens; the prefill KV pool holds "
                                                   f"{self.max_prompt}")
        if n + max(1, request.sampling.max_tokens) > self.context_length:
            raise invalid("CONTEXT_EXCEEDED", f"prompt is {n} tokens + max_tokens {request.sampling.max_tokens}; "
                                              f"the context length is {self.context_length}")
        dest = request.destination
        if dest.layout != self.layout_pb:
            raise invalid("LAYOUT_MISMATCH", f"destination layout {dest.layout} differs from prefill's {self.layout_pb}")
        if len(request.request_id) != 16:
            raise invalid("BAD_DESTINATION", f"request_id must be 16 bytes, got {len(request.request_id)}")
        need = pages_for(n, self.worker.pool.page_size)
        if len(dest.leases) < need:
            raise invalid("BAD_DESTINATION", f"prompt is {n} tokens ({need} pages); destination leases "
                                              f"{len(dest.leases)} pages")
        return Target(dest.transfer_session, dest.data_base, dest.tag_base, dest.epoch,
                      leases_from_pb(dest.leases[:need]))

    async def Prefill(self, request, context) -> prefill_pb2.PrefillResponse:
        target = self._admit(request)
        # shielded: a cancelled caller must not stop a write half-way, nor skip its EndWrite
        return await asyncio.shield(self._prefill(request, target))

    async def _keep_alive(self, writer_id: str, epoch: int) -> float:
        """Renews this write's liveness lease; returns the monotonic time it now expires (sent time + ttl).
        Under a new broker epoch the write is dead: its pages are quarantined only for lock_delay there,
        so it must not post again (found by the formal model)."""
        sent = time.monotonic()
        resp = await call(self.broker.KeepAlive(broker_pb2.KeepAliveRequest(
            holder_id=writer_id, ttl_ms=int(self.writer_ttl_s * 1000)), timeout=self.rpc_timeout_s), "broker KeepAlive")
        if resp.epoch != epoch:
            raise PdError(grpc.StatusCode.UNAVAILABLE, "BROKER_RESTARTED",
                          f"broker epoch is {resp.epoch:#x}, the write's leases are of {epoch:#x}")
        return sent + self.writer_ttl_s

    async def _begin_write(self, pool_id: str, owner: bytes, epoch: int, leases_pb,
                           writer_id: str) -> tuple[list[float], asyncio.Task]:
        """KeepAlive, then BeginWrite; returns [liveness expiry] and the task that renews it from now on
        (a long forward pass must not let the write's liveness lease lapse)."""
        expires = [await self._keep_alive(writer_id, epoch)]
        try:
            with GUARD_SECONDS.labels("begin_write_rpc").time():
                await call(self.broker.BeginWrite(broker_pb2.BeginWriteRequest(
                    pool_id=pool_id, owner=owner, epoch=epoch, leases=leases_pb, writer_id=writer_id),
                    timeout=self.rpc_timeout_s), "broker BeginWrite")
        except PdError as e:
            TRANSFER_FAILURES.labels("begin_write").inc()
            if e.reason in ("LEASE_NOT_CURRENT", "WRITER_ACTIVE"):
                LEASE_VIOLATIONS.labels("prefill", e.reason).inc()
                raise PdError(grpc.StatusCode.DATA_LOSS, e.reason, e.message) from None
            if e.reason == "EPOCH_MISMATCH":
                raise PdError(grpc.StatusCode.UNAVAILABLE, e.reason, e.message) from None
            raise
        return expires, asyncio.create_task(self._renew(writer_id, epoch, expires))

    @staticmethod
    async def _begun(begin: asyncio.Future) -> asyncio.Task | None:
        """The renewal task once BeginWrite has answered yes, else None (its failure is already counted)."""
        try:
            return (await begin)[1]
        except Exception as e:  # noqa: BLE001
            log.info("BeginWrite failed after the forward pass had failed: %s", e)
            return None

    async def _prefill(self, request, target: Target) -> prefill_pb2.PrefillResponse:
        owner = request.request_id
        pool_id = request.destination.pool_id
        leases_pb = leases_to_pb(target.leases)
        # one liveness lease per write: a stuck write stops being renewed at its timeout, so the broker can
        # presume it dead and drain its pages, while the rest of this process keeps serving
        writer_id = f"{self.writer_id}/{owner.hex()}"
        # KeepAlive and BeginWrite run while the forward pass fills this process's own pool: the pass reads
        # and writes nothing of decode's, and nothing is posted to decode before BeginWrite has succeeded
        begin = asyncio.ensure_future(self._begin_write(pool_id, owner, target.epoch, leases_pb, writer_id))
        local: list[int] = []
        try:
            n = len(request.token_ids)
            local = await self._allocate_local(pages_for(n, self.worker.pool.page_size))
            sampling = sampling_from_pb(request.sampling)
            async with self._compute:
                first = await asyncio.to_thread(self.worker.forward, list(request.token_ids), local, sampling)
        except BaseException:
            await self._free_local(local)
            if (renew := await self._begun(begin)) is not None:  # acknowledge the write that never posted
                renew.cancel()
                await self._end_write(pool_id, owner, target.epoch, leases_pb, writer_id, False)
            raise
        waited = time.perf_counter()
        try:
            expires, renew = await begin
        except BaseException:
            await self._free_local(local)
            raise
        # what the lease RPCs still add to time to first token once they overlap the forward pass
        GUARD_SECONDS.labels("begin_write_wait").observe(time.perf_counter() - waited)
        ok = False
        write = None
        try:
            if (arg := FAULTS.fire("prefill.delay_before_write")) is not None:
                await asyncio.sleep(int(arg or 1000) / 1000)

            def check_alive(stage: str) -> None:
                left = expires[0] - time.monotonic()
                if left < self.liveness_margin_s:
                    raise TransferError("liveness", f"writer {writer_id}: liveness lease has {left:.2f}s left, "
                                                    f"under the {self.liveness_margin_s}s margin; not posting {stage}")

            write = asyncio.ensure_future(asyncio.to_thread(self.worker.write, owner, local, n, target, check_alive))
            try:
                written = await asyncio.wait_for(asyncio.shield(write), self.transfer_timeout_s)
            except asyncio.TimeoutError:
                TRANSFER_FAILURES.labels("timeout").inc()
                TIMEOUTS.labels("transfer").inc()
                raise PdError(grpc.StatusCode.DEADLINE_EXCEEDED, "TRANSFER_TIMEOUT",
                              f"KV transfer to {target.session} took over {self.transfer_timeout_s:.1f}s") from None
            except TransferError as e:
                TRANSFER_FAILURES.labels(e.stage).inc()
                raise PdError(grpc.StatusCode.UNAVAILABLE, "TRANSFER_FAILED", str(e)) from None
            TRANSFER_BYTES.inc(written.nbytes)
            TRANSFER_SECONDS.observe(written.seconds)
            ok = True
            return prefill_pb2.PrefillResponse(first_token=first, coverage=common_pb2.Coverage(
                num_tokens=written.num_tokens, num_pages=written.num_pages, checksums=written.checksums))
        finally:
            renew.cancel()
            if write is not None and not write.done():
                # the writer thread still holds the local pages and may still post: ack only once it returns
                write.add_done_callback(lambda fut: spawn(self._late_finish(
                    fut, local, pool_id, owner, target.epoch, leases_pb, writer_id)))
            else:
                await self._finish(local, pool_id, owner, target.epoch, leases_pb, writer_id, ok)

    async def _renew(self, writer_id: str, epoch: int, expires: list[float]) -> None:
        while True:
            await asyncio.sleep(self.writer_ttl_s / 3)
            try:
                expires[0] = await self._keep_alive(writer_id, epoch)
            except PdError as e:
                log.warning("KeepAlive of %s failed: %s", writer_id, e)
                if e.reason == "BROKER_RESTARTED":
                    expires[0] = 0.0  # check_alive now refuses every further post
                    return

    async def _late_finish(self, write: asyncio.Future, *args) -> None:
        """A write that outlived its timeout has returned: count how it ended, then acknowledge it."""
        err = write.exception()
        if isinstance(err, TransferError):
            TRANSFER_FAILURES.labels(err.stage).inc()
        log.warning("late write of %s ended after its timeout: %s", args[2].hex(), err or "completed")
        await self._finish(*args, False)

    async def _finish(self, local: list[int], pool_id, owner, epoch, leases_pb, writer_id: str, ok: bool) -> None:
        await self._free_local(local)
        await self._end_write(pool_id, owner, epoch, leases_pb, writer_id, ok)

    async def _free_local(self, local: list[int]) -> None:
        if local:
            self.worker.alloc.deallocate(local)
            async with self._pages_freed:
                self._pages_freed.notify_all()

    async def _allocate_local(self, need: int) -> list[int]:
        async with self._pages_freed:
            await asyncio.wait_for(self._pages_freed.wait_for(lambda: self.worker.alloc.can_allocate(need)),
                                   timeout=self.rpc_timeout_s * 3)
            return self.worker.alloc.allocate(need)

    async def _end_write(self, pool_id, owner, epoch, leases_pb, writer_id: str, ok: bool) -> None:
        if FAULTS.fire("prefill.lose_end_write") is not None:
            return
        req = broker_pb2.EndWriteRequest(pool_id=pool_id, owner=owner, epoch=epoch, leases=leases_pb,
                                         writer_id=writer_id, success=ok)
        for attempt in range(3):  # the acknowledgement matters: the pages stay quarantined without it
            try:
                with GUARD_SECONDS.labels("end_write_rpc").time():
                    await self.broker.EndWrite(req, timeout=self.rpc_timeout_s)
                return
            except grpc.RpcError as e:
                log.warning("EndWrite attempt %d for %s failed: %s", attempt + 1, owner.hex(), e)
                await asyncio.sleep(0.2 * (attempt + 1))
        TRANSFER_FAILURES.labels("end_write").inc()
