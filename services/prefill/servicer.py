"""Prefill gRPC servicer: re-checks admission, BeginWrite, forward, transfer, EndWrite in every outcome."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from ..common.admission import check_options, check_sampling, check_tokens, start_grammar
from ..common.config import pages_for
from ..common.deadline import deadline_exceeded, deadline_of
from ..common.drain import draining_error
from ..common.errors import PdError, invalid
from ..common.faults import FAULTS
from ..common.metrics import (GUARD_SECONDS, TIMEOUTS, TRANSFER_BYTES, TRANSFER_FAILURES,
                              TRANSFER_SECONDS, count_violation)
from ..common.prefix import CHAINS_INLINE_TOKENS, KEY_NBYTES, page_chains
from ..common.proto import common_pb2, prefill_pb2, prefill_pb2_grpc
from ..common.tasks import spawn
from ..common.wire import (layout_to_pb, leases_from_pb, leases_to_pb, logprobs_to_pb, prompt_digest,
                           sampling_from_pb)
from ..engine.grammar import Grammars
from ..engine.tags import TAG_NBYTES
from ..kvtransfer.engine import TransferError
from .batcher import Batcher, Queued
from .local_pages import Reservation
from .worker import PrefillWorker, Progress, Prompt, Target
from .writelease import WriteLeases

log = logging.getLogger(__name__)



class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker, leases: WriteLeases, context_length: int, max_prompt: int,
                 model_name: str, transfer_timeout_s: float = 30.0, max_batch_tokens: int = 2048,
                 queue_limit: int = 256, grammars: Grammars | None = None):
        """grammars: compiles structured output's grammars (None: such requests are refused)."""
        self.grammars = grammars
        self.leases = leases
        self.transfer_timeout_s = transfer_timeout_s
        self.worker = worker
        self.context_length = context_length
        self.max_prompt = max_prompt  # capped by the local pool
        self.model_name = model_name
        self.local = worker.local
        self.batcher = Batcher(worker.forward, self.local, worker.pool.page_size, max_batch_tokens, queue_limit)
        self.layout_pb = layout_to_pb(worker.pool.layout, TAG_NBYTES)
        self.draining = False  # set on SIGTERM (drain.py): GetInfo reports it, Prefill refuses
        self.in_flight: set[asyncio.Task] = set()  # queued for a forward pass or running, until EndWrite
        self.drain_expired = asyncio.Event()  # set when the drain timeout ends

    async def GetInfo(self, request, context) -> common_pb2.EngineInfo:
        cfg = self.worker.runner.config
        return common_pb2.EngineInfo(
            model=self.model_name, context_length=self.context_length, vocab_size=cfg.vocab_size,
            pool_pages=self.worker.pool.num_pages, page_size=self.worker.pool.page_size,
            eos_token_id=cfg.eos_token_id if cfg.eos_token_id is not None else -1,
            layout=self.layout_pb, free_pages=self.local.num_available,
            queue_depth=len(self.in_flight),
            draining=self.draining)

    def load(self) -> tuple[int, int]:
        """(running, waiting) for pdserve_requests_running/_waiting: prompts past the queue (in a forward pass, or
        their KV being written until EndWrite), and prompts queued for their first forward pass."""
        waiting = self.batcher.num_waiting
        return max(0, len(self.in_flight) - waiting), waiting

    def _admit(self, request) -> list[tuple[int, int]]:
        """The leases the prompt needs (one per page after the destination's cached pages), after the admission
        checks."""
        tokens = request.token_ids
        check_tokens(tokens, self.worker.runner.config.vocab_size)
        check_sampling(request.sampling.max_tokens or 1, request.sampling.temperature, request.sampling.top_p or 1.0)
        check_options(sampling_from_pb(request.sampling), self.worker.runner.config.vocab_size,
                      request.prompt_logprobs if request.HasField("prompt_logprobs") else None)
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
        if len(request.prefix_scope) not in (0, KEY_NBYTES):
            raise invalid("BAD_PREFIX_SCOPE", f"prefix_scope must be {KEY_NBYTES} bytes or empty, got "
                                              f"{len(request.prefix_scope)}")
        ps = self.worker.pool.page_size
        total, cached = pages_for(n, ps), dest.cached_pages
        if cached > (n - 1) // ps:
            # the page of the last prompt token is always written: decode needs its tag to count the prompt
            raise invalid("BAD_DESTINATION", f"destination has {cached} cached pages; a prompt of {n} tokens in "
                                              f"pages of {ps} has at most {(n - 1) // ps}")
        need = total - cached
        if len(dest.leases) < need:
            raise invalid("BAD_DESTINATION", f"prompt is {n} tokens ({total} pages, {cached} cached); destination "
                                              f"leases {len(dest.leases)} pages, {need} needed")
        return leases_from_pb(dest.leases[:need])

    def _target(self, request, region, leases) -> Target:
        """Where the bytes go: the pool's region as decode registered it with the broker. The request's own
        addresses are only compared with it; a caller holding one valid lease could otherwise aim the data at
        another request's pages while the tags stay intact."""
        dest = request.destination
        named = (dest.transfer_session, dest.data_base, dest.tag_base)
        registered = (region.transfer_session, region.data_base, region.tag_base)
        if named != registered or region.layout != self.layout_pb:
            count_violation("prefill", "DESTINATION_MISMATCH", request.request_id)
            raise PdError(grpc.StatusCode.PERMISSION_DENIED, "DESTINATION_MISMATCH",
                          f"the request names destination {named[0]} data {named[1]:#x} tags {named[2]:#x}; pool "
                          f"{dest.pool_id} is registered at {registered[0]} data {registered[1]:#x} tags "
                          f"{registered[2]:#x}")
        return Target(*registered, dest.epoch, leases)

    async def Prefill(self, request, context) -> prefill_pb2.PrefillResponse:
        if self.draining:
            raise draining_error("prefill", "no new Prefill call is taken")
        leases = self._admit(request)
        deadline = None if context is None else deadline_of(context)
        tokens = list(request.token_ids)
        chains = await self._chains(request.prefix_scope, tokens)
        sampling = sampling_from_pb(request.sampling)
        grammar = await start_grammar(self.grammars, sampling.grammar, request.sampling.grammar_prefix)
        # a drain that began while a long prompt's chain was hashed or its grammar compiled: nothing of it is queued
        if self.draining:
            raise draining_error("prefill", "no new Prefill call is taken")
        queued = self.batcher.submit(Prompt(tokens, sampling,
                                            request.prompt_logprobs if request.HasField("prompt_logprobs") else None,
                                            chains=chains, cached_pages=request.destination.cached_pages,
                                            grammar=grammar),
                                     deadline)
        work = asyncio.ensure_future(self._prefill(request, leases, deadline, queued))
        self.in_flight.add(work)
        work.add_done_callback(self._work_done)
        # not cancelled with the caller (nor at the drain timeout): a write must not stop half-way or skip EndWrite;
        # only a prompt still queued is dropped when its caller leaves
        expired = asyncio.ensure_future(self.drain_expired.wait())
        try:
            await asyncio.wait({work, expired}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self.batcher.leave(queued)
            raise
        finally:
            expired.cancel()
        if not work.done():
            raise draining_error("prefill", "its drain timeout ended this call before the KV was written")
        return work.result()

    async def _chains(self, scope: bytes, tokens: list[int]) -> list[bytes]:
        """The chain key of every full page under the request's scope ([] without one). A hash per page costs
        ~0.3 µs a token: a long prompt's (0.3 s for 1,048,576 tokens) is computed off the event loop."""
        if not scope:
            return []
        args = (self.worker.runner.chain_seed(scope), tokens, self.worker.pool.page_size)
        with GUARD_SECONDS.labels("prefix_chain").time():
            if len(tokens) < CHAINS_INLINE_TOKENS:
                return page_chains(*args)
            return await asyncio.to_thread(page_chains, *args)

    def _work_done(self, work: asyncio.Task) -> None:
        self.in_flight.discard(work)
        if not work.cancelled():
            work.exception()  # retrieved: a caller that left (or was failed by the drain) no longer awaits it

    @staticmethod
    async def _begun(begin: asyncio.Future) -> asyncio.Task | None:
        """The renewal task once BeginWrite has answered yes, else None (its failure is already counted)."""
        try:
            return (await begin)[1]
        except Exception as e:  # noqa: BLE001
            log.info("BeginWrite failed after the forward pass had failed: %s", e)
            return None

    async def _prefill(self, request, leases: list[tuple[int, int]], deadline: float | None,
                       queued: Queued) -> prefill_pb2.PrefillResponse:
        """deadline (the caller's) bounds the lease calls, the wait in the queue for a forward pass and when the
        write may still be posted: work nobody waits for any more is not started (EndWrite then frees its pages at
        once, nothing posted)."""
        owner = request.request_id
        dest = request.destination
        pool_id, epoch = dest.pool_id, dest.epoch
        leases_pb = leases_to_pb(leases)
        # one liveness lease per write (renewed with the others of this process): a stuck write stops being renewed
        # at its timeout, so the broker can presume it dead and drain its pages, while the rest keeps serving
        writer_id = f"{self.leases.writer_prefix}/{owner.hex()}"
        end = (pool_id, owner, epoch, leases_pb, writer_id)
        # BeginWrite (which starts the write's liveness) runs while the prompt waits for and runs its forward pass
        # into this process's own pool: the pass reads and writes nothing of decode's, and nothing is posted to
        # decode before BeginWrite has succeeded
        begin = asyncio.ensure_future(self.leases.begin(pool_id, owner, epoch, leases_pb, writer_id, deadline))
        prompt = queued.prompt
        try:
            fwd = await self.batcher.result(queued)
        except BaseException:
            await self._free_local(prompt)
            if (renew := await self._begun(begin)) is not None:  # acknowledge the write that never posted
                renew.cancel()
                await self.leases.end(*end, False, nothing_posted=True)
            raise
        waited = time.perf_counter()
        try:
            expires, renew, region = await begin
        except BaseException:
            await self._free_local(prompt)
            raise
        # what the lease RPCs still add to time to first token once they overlap the forward pass
        GUARD_SECONDS.labels("begin_write_wait").observe(time.perf_counter() - waited)
        progress = Progress()
        ok = False
        write = coverage = written = None
        try:
            target = self._target(request, region, leases)
            if (arg := FAULTS.fire("prefill.delay_before_write", owner)) is not None:
                await asyncio.sleep(int(arg or 1000) / 1000)
            if deadline is not None and time.monotonic() >= deadline:
                raise deadline_exceeded(deadline, "before prefill posted the KV write (nothing was posted)")

            def check_alive(stage: str) -> None:
                left = expires[0] - time.monotonic()
                if left < self.leases.liveness_margin_s:
                    raise TransferError("liveness", f"writer {writer_id}: liveness lease has {left:.2f}s left, under "
                                                    f"the {self.leases.liveness_margin_s}s margin; not posting {stage}")

            write = asyncio.ensure_future(asyncio.to_thread(self.worker.send, owner, prompt, target, check_alive,
                                                            progress))
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
            coverage = common_pb2.Coverage(num_tokens=written.num_tokens, num_pages=written.num_pages,
                                           checksums=written.checksums)
            ok = True
            return prefill_pb2.PrefillResponse(
                first_token=fwd.first_token, coverage=coverage,
                first_logprobs=logprobs_to_pb(fwd.first_logprobs) if fwd.first_logprobs else None,
                prompt_logprobs=[logprobs_to_pb(lp) for lp in fwd.prompt_logprobs])
        finally:
            renew.cancel()
            if write is not None and not write.done():
                # the writer thread still holds the local pages and may still post: ack only once it returns
                write.add_done_callback(lambda fut: spawn(self._late_finish(fut, prompt, progress, end)))
            else:
                # a successful EndWrite carries what decode needs to start: the broker's notice hands it over
                await self._finish(prompt, progress, end, ok, coverage, fwd.first_token,
                                   prompt_digest(request.token_ids) if ok else b"",
                                   written.page_crcs if ok else None)

    async def _late_finish(self, write: asyncio.Future, prompt: Prompt, progress: Progress, end: tuple) -> None:
        """A write that outlived its timeout has returned: count how it ended, then acknowledge it."""
        err = write.exception()
        if isinstance(err, TransferError):
            TRANSFER_FAILURES.labels(err.stage).inc()
        log.warning("late write of %s ended after its timeout: %s", end[1].hex(), err or "completed")
        await self._finish(prompt, progress, end, False)

    async def _finish(self, prompt: Prompt, progress: Progress, end: tuple, ok: bool, coverage=None,
                      first_token: int = 0, digest: bytes = b"", page_crcs: dict[int, int] | None = None) -> None:
        """Gives back the source pages (a successful write's full prompt pages enter the prefix cache) and
        acknowledges the write. A failed write that posted anything may still be reading the source pages and
        landing bytes: the broker holds the destination for lock_delay from its ack, and the source pages stay out
        of reuse (and out of the cache) for the landing bound from now (the call has returned)."""
        res = prompt.reservation
        if ok or not progress.posted or res is None:
            await self._free_local(prompt, page_crcs)
        else:
            self.local.hold_after_failed_write(res, self.leases.max_landing_s)
            self.batcher.computed(prompt)  # none of its pages will be cached: a prompt waiting for them computes them
            spawn(self._release_when_safe(res))
        await self.leases.end(*end, ok, nothing_posted=not progress.posted, coverage=coverage,
                              first_token=first_token, prompt_digest=digest)

    async def _release_when_safe(self, res: Reservation) -> None:
        # on LocalPages' own clock: release_held refuses a moment too early, and a sleep may wake a hair early
        while (left := res.safe_at - self.local.clock()) > 0:
            await asyncio.sleep(left)
        self.local.release_held(res)
        self.batcher.wake()

    async def _free_local(self, prompt: Prompt, page_crcs: dict[int, int] | None = None) -> None:
        """Gives back the prompt's local pages, if its first pass took any: its cache hit unpinned, its own full
        pages cached when page_crcs (a successful write's CRC-32C by page index) is given, the rest freed."""
        if prompt.reservation is not None:
            self.local.finish(prompt.reservation, page_crcs)
        # a prompt may be waiting for these, for the cache's pages it no longer pins, or for its prefix
        self.batcher.computed(prompt)
