"""Decode gRPC servicer: leases pages through the broker, verifies prompt pages, streams tokens."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
import torch

from ..common.admission import check_lengths, check_sampling, start_grammar
from ..common.deadline import deadline_of, timeout_within
from ..common.config import DEFAULT_HEADROOM_PAGES, pages_for, pages_needed, pages_up_front
from ..common.drain import draining_error
from ..common.errors import PdError, invalid
from ..common.metrics import GUARD_SECONDS, TIMEOUTS, count_violation
from ..common.prefix import CHAINS_INLINE_TOKENS
from ..common.tasks import spawn
from ..common.proto import broker_pb2, common_pb2, decode_pb2, decode_pb2_grpc
from ..common.wire import call, layout_to_pb, leases_to_pb, logprobs_to_pb
from ..engine.grammar import Grammars
from ..engine.runner import ModelRunner
from ..engine.tags import TAG_NBYTES, expected_tags
from ..engine.sampler import SamplingParams
from .admit import admit_decode
from .allocations import Allocation
from .growth import Growth
from .grants import Grants
from .lease import LeaseClient
from .requests import RequestTable, State
from .reuse import plan_prefix
from .run import GrantQueue, Notices
from .scheduler import Scheduler, Sequence, raise_if_ended
from .sweep import PromptRecord
from .verify import Violation, check_canaries, verify_prompt_pages
from .watch import BrokerWatch

log = logging.getLogger(__name__)

FINISH = {True: common_pb2.FINISH_REASON_STOP, False: common_pb2.FINISH_REASON_LENGTH}


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """The gRPC translation of decode: parses requests, calls its parts and maps their errors to status codes.
    Each part is the one owner of its state: the request table (every request's state, from its Grant to its
    release), the link to the broker (pool incarnation, liveness, revocations), the queue for pages, the write-done
    notices, and the step loop (which steps the table's running requests)."""

    def __init__(self, runner: ModelRunner, broker, pool_id: str, transfer_session: str, context_length: int,
                 model_name: str, max_batch: int = 64, rpc_timeout_s: float = 10.0, allocation_timeout_s: float = 120.0,
                 check_checksums: bool = True, canary: bool = False, sweep_pages: int = 8, max_blind_s: float = 1.0,
                 sweep_every: int = 1, queue_limit: int = 256, queue_timeout_s: float = 30.0,
                 headroom_pages: int = DEFAULT_HEADROOM_PAGES, growth_pages: int = 8, preempt_after_s: float = 0.5,
                 allocation_timeout_per_token_s: float = 0.005, prefix_cache: bool = True,
                 grammars: Grammars | None = None):
        """grammars: compiles structured output's grammars (None: such requests are refused)."""
        self.grammars = grammars
        self.check_checksums, self.canary = check_checksums, canary
        self.runner, self.pool, self.broker = runner, runner.pool, broker
        self.session = transfer_session
        self.context_length, self.model_name = context_length, model_name
        self.rpc_timeout_s = rpc_timeout_s
        self.requests = RequestTable()
        self.link = BrokerWatch(broker, self, pool_id, self.pool.num_pages, max_blind_s, rpc_timeout_s)
        self.leases = LeaseClient(broker, self.link, rpc_timeout_s)  # every lease RPC of decode's
        self.headroom_pages = headroom_pages
        self.growth = Growth(self.leases.extend, self.pool.page_size, headroom_pages, growth_pages, preempt_after_s,
                             wake=self.requests.wake, mark=self.requests.mark,
                             on_broker_moved=self.link.epoch_changed.set)
        self.scheduler = Scheduler(runner, self._release_seq, max_batch, sweep_pages if check_checksums else 0,
                                   blind=self.link.blind_error, sweep_every=sweep_every, requests=self.requests,
                                   growth=self.growth)
        self.queue = GrantQueue(queue_limit, queue_timeout_s, lambda: self.draining)
        self.notices = Notices(self.pool.page_size, self.link.blind_error)
        self.grants = Grants(self.pool, self.requests, self.leases, self.link, self.growth, self.queue,
                             rpc_timeout_s, allocation_timeout_s, allocation_timeout_per_token_s, check_checksums,
                             canary)
        self.layout_pb = layout_to_pb(self.pool.layout, TAG_NBYTES)
        self.eos = frozenset(runner.config.eos_token_ids)
        self.draining = False  # set on SIGTERM (drain.py): GetInfo reports it, Allocate refuses
        # prefix reuse (reuse.py): off, decode still checks the chain words prefill writes, but shares and
        # publishes nothing
        self.prefix_cache = prefix_cache

    @property
    def pool_id(self) -> str:  # the current incarnation: a move to another broker changes it
        return self.link.pool_id

    @property
    def epoch(self) -> int:
        return self.link.epoch

    def blind_error(self) -> PdError | None:
        return self.link.blind_error()

    @property
    def allocations(self):  # the ALLOCATED owners (read-only)
        return self.requests.allocations

    @property
    def pending_grants(self) -> set[bytes]:  # owners whose Grant is in flight
        return set(self.requests.owners(State.GRANTING))

    @property
    def readonly(self) -> dict[bytes, frozenset[int]]:  # owner -> its cached pages: never canary-filled
        return self.requests.readonly_pages()

    @property
    def publishing(self) -> dict[bytes, asyncio.Future]:  # owner -> its Publish, awaited by its release
        return self.requests.publishes()

    # -- what the broker link needs of decode (watch.Holder) --
    def held_owners(self) -> set[bytes]:
        """Every owner whose pages decode may still use or write, the step in flight included: the broker revokes
        the others after its grace, and frees a revoked owner's pages only once it is no longer listed here."""
        return self.requests.held_owners()

    def region(self) -> broker_pb2.PoolRegion:
        return broker_pb2.PoolRegion(transfer_session=self.session, data_base=self.pool.data_ptr,
                                     tag_base=self.pool.tag_ptr, layout=self.layout_pb)

    async def GetInfo(self, request, context) -> common_pb2.EngineInfo:
        cfg = self.runner.config
        state = await call(self.broker.GetPoolState(broker_pb2.GetPoolStateRequest(pool_id=self.pool_id),
                                                    timeout=self.rpc_timeout_s), "broker GetPoolState")
        return common_pb2.EngineInfo(
            model=self.model_name, context_length=self.context_length, vocab_size=cfg.vocab_size,
            pool_pages=self.pool.num_pages, page_size=self.pool.page_size,
            eos_token_id=cfg.eos_token_id if cfg.eos_token_id is not None else -1,
            layout=self.layout_pb,
            # unread cached pages are evicted by the next Grant that needs them: free, as far as admission goes
            free_pages=state.num_free + state.num_evictable, draining=self.draining, queue_depth=self.queue_depth())

    def load(self) -> tuple[int, int]:
        """(running, waiting) for pdserve_requests_running/_waiting: sequences in or joining the batch, and requests
        queued for KV pages. In neither: allocations whose KV prefill is still writing (prefill counts those)."""
        return len(self.scheduler.running) + len(self.scheduler.joining), len(self.queue)

    def queue_depth(self) -> int:  # waiting for pages, allocated, not yet decoding, plus every sequence decoding
        return len(self.queue) + len(self.allocations) + len(self.scheduler.joining) + len(self.scheduler.running)

    async def Allocate(self, request, context) -> decode_pb2.AllocateResponse:
        owner = request.request_id
        need = self.admit_allocation(owner, request.num_prompt_tokens, request.max_tokens)
        alloc = await self.grants.grant(owner, request.num_prompt_tokens, request.max_tokens, need,
                                        deadline_of(context))
        return decode_pb2.AllocateResponse(destination=self.destination(alloc))

    def admit_allocation(self, owner: bytes, num_prompt_tokens: int, max_tokens: int) -> int:
        """The pages a request is granted up front, once it may ever have all it needs here (prompt + max_tokens:
        what can never fit is refused before any lease); the rest is leased as it generates (growth.py)."""
        if self.draining:
            raise draining_error("decode", f"pool {self.pool_id} takes no new allocation")
        if len(owner) != 16:
            raise invalid("BAD_REQUEST_ID", f"request_id must be 16 bytes, got {len(owner)}")
        check_sampling(max_tokens, 0.0, 1.0)
        check_lengths(num_prompt_tokens, max_tokens, self.context_length, self.pool.page_size,
                      self.pool.num_pages, None)
        if num_prompt_tokens == 0:
            raise invalid("EMPTY_PROMPT", "prompt is empty (0 tokens)")
        return pages_up_front(num_prompt_tokens, max_tokens, self.pool.page_size, self.headroom_pages)

    def destination(self, alloc: Allocation) -> common_pb2.Destination:
        k = alloc.num_shared
        return common_pb2.Destination(pool_id=alloc.pool_id, transfer_session=self.session,
                                      data_base=self.pool.data_ptr, tag_base=self.pool.tag_ptr, epoch=alloc.epoch,
                                      leases=leases_to_pb(alloc.leases[k:]), layout=self.layout_pb, cached_pages=k)

    async def Release(self, request, context) -> decode_pb2.DecodeReleaseResponse:
        alloc = self.requests.end_allocation(request.request_id, PdError(
            grpc.StatusCode.CANCELLED, "RELEASED", f"request {request.request_id.hex()} was released by its caller"))
        if alloc is not None:
            # shielded: the allocation is already popped, so a cancelled caller must not stop the release
            await asyncio.shield(self.release(request.request_id, alloc.epoch, alloc.leases))
        else:
            self.scheduler.cancel(request.request_id)
        return decode_pb2.DecodeReleaseResponse()

    async def Decode(self, request, context):
        owner = request.request_id
        alloc = self.requests.take(owner)
        if alloc is None:
            raise PdError(grpc.StatusCode.FAILED_PRECONDITION, "UNKNOWN_REQUEST",
                          f"request {owner.hex()} has no allocation on pool {self.pool_id} (released, revoked "
                          f"or timed out)")
        async for r in self.decode_stream(request, alloc, deadline_of(context)):
            yield r

    async def Run(self, request, context):
        """Allocate and Decode in one stream: grant (queueing while the pool is short), send the destination, wait
        for the broker's write-done notice, then verify and decode."""
        owner, deadline = request.request_id, deadline_of(context)
        sampling = request.sampling
        if len(request.prompt_digest) != 16:
            raise invalid("BAD_PROMPT_DIGEST", f"prompt_digest must be 16 bytes, got {len(request.prompt_digest)}")
        need = self.admit_allocation(owner, request.num_prompt_tokens, sampling.max_tokens)
        args = (request.prefix_scope, request.prompt_token_ids, request.num_prompt_tokens, request.prompt_digest,
                self.runner.config.vocab_size, self.runner.chain_seed, self.pool.page_size, self.prefix_cache)
        with GUARD_SECONDS.labels("prefix_chain").time():
            plan = (plan_prefix(*args) if request.num_prompt_tokens < CHAINS_INLINE_TOKENS
                    else await asyncio.to_thread(plan_prefix, *args))
        alloc = await self.queue.granted(
            lambda: self.grants.grant(owner, request.num_prompt_tokens, sampling.max_tokens, need, deadline, plan),
            need, self.pool_id, deadline)
        fut = self.notices.expect(owner)
        try:
            yield decode_pb2.RunEvent(destination=self.destination(alloc))
            notice = await self.notices.wait(owner, alloc, fut, deadline, request.prompt_digest,
                                             self.grants.allocation_timeout(request.num_prompt_tokens))
            if self.requests.take(owner, alloc) is None:  # ended between the notice and now
                raise alloc.ended or PdError(grpc.StatusCode.INTERNAL, "ALLOCATION_GONE",
                                             f"the allocation of {owner.hex()} ended for no recorded reason")
        except BaseException:
            # never reached decoding: if the allocation is still ours to end, give the pages back
            if self.requests.drop_allocation(owner, alloc) is not None:
                await asyncio.shield(self.release(owner, alloc.epoch, alloc.leases))
            raise
        finally:
            self.notices.forget(owner)
        dreq = decode_pb2.DecodeRequest(request_id=owner, num_prompt_tokens=request.num_prompt_tokens,
                                        first_token=notice.first_token, sampling=sampling,
                                        coverage=notice.coverage, prompt_token_ids=request.prompt_token_ids,
                                        handed_back=request.handed_back)
        async for r in self.decode_stream(dreq, alloc, deadline, validate=False):
            yield decode_pb2.RunEvent(token=r)

    async def decode_stream(self, request, alloc: Allocation, deadline: float | None, validate: bool = True):
        """Verifies the prompt pages, then streams the tokens. validate=False: the broker's write-done notice of
        these leases (Run) came, and stands for the Validate call."""
        owner = request.request_id
        # from here the request's pages are released exactly once: by the scheduler once it runs the sequence,
        # else by the finally below, whatever ends this call (error, finish, or cancellation). While joining,
        # the scheduler already knows the sequence, so a revocation or Release in that window is not lost.
        expected = expected_tags(owner, alloc.epoch, alloc.leases)
        if alloc.num_shared:  # cached pages carry their publisher's tag, checked when they were shared
            expected[:alloc.num_shared] = alloc.shared_words
        seq = Sequence(owner, alloc.epoch, alloc.leases, expected, alloc.num_prompt_tokens, SamplingParams(),
                       self.eos, [request.first_token], handed_back=request.handed_back)
        self.scheduler.join(seq)
        try:
            await self._verify(request, owner, alloc, seq, deadline, validate)
            checksums = [*alloc.shared_checksums, *request.coverage.checksums]
            if self.check_checksums:  # verification proved the pages' bytes carry these checksums
                seq.prompt = PromptRecord.of(alloc.leases, alloc.num_prompt_tokens, self.pool.page_size, checksums)
            if alloc.plan is not None and self.prefix_cache:
                self.requests.publish_started(owner, spawn(self.grants.publish(owner, alloc, checksums)))
            seq.max_pages = pages_needed(alloc.num_prompt_tokens, seq.sampling.max_tokens, self.pool.page_size)
            # structured output: the grammar must accept the tokens generated before (a resubmission's) and prefill's
            # first token before that token is sent; a refusal ends the request, never its output
            seq.grammar = await start_grammar(self.grammars, seq.sampling.grammar,
                                              [*request.sampling.grammar_prefix, request.first_token])
            raise_if_ended(seq)
            if (err := self.blind_error()) is not None:
                raise err
            finished = seq.is_finished()
            yield decode_pb2.DecodeResponse(token_id=request.first_token, finish_reason=self._finish(seq, finished))
            if finished:
                return
            self.scheduler.add(seq)  # raises if marked while the first token was being sent
            while True:
                event = await seq.events.get()
                if isinstance(event, PdError):
                    raise event
                tok, finished, lp = event
                yield decode_pb2.DecodeResponse(token_id=tok, finish_reason=self._finish(seq, finished),
                                                logprobs=logprobs_to_pb(lp) if lp is not None else None)
                if finished:
                    return
        finally:
            if owner not in self.scheduler.running and not seq.done:
                # never ran: a task, so a cancelled call still gives the pages back
                self.scheduler.leave(owner)
                spawn(self.release(owner, alloc.epoch, alloc.leases))
            elif not seq.done:
                self.scheduler.cancel(owner)  # the client went away: stop before the next step

    async def _verify(self, request, owner: bytes, alloc: Allocation, seq: Sequence, deadline: float | None,
                      validate: bool = True) -> None:
        """Prompt pages (tags, token counts, checksums), then the broker (unless its write-done notice came):
        fail closed with DATA_LOSS."""
        if alloc.epoch != self.epoch or alloc.pool_id != self.pool_id:
            raise PdError(grpc.StatusCode.UNAVAILABLE, "BROKER_RESTARTED",
                          f"leases of pool {alloc.pool_id} epoch {alloc.epoch:#x} ended with the move to pool "
                          f"{self.pool_id} epoch {self.epoch:#x}")
        try:
            seq.sampling = admit_decode(request, alloc.num_prompt_tokens, alloc.max_tokens,
                                        self.runner.config.vocab_size, ids_checked=alloc.plan is not None)
            if seq.sampling.repetition_penalty != 1.0:
                seq.prompt_token_ids = torch.tensor(request.prompt_token_ids, dtype=torch.int64)
            cov = request.coverage
            with GUARD_SECONDS.labels("prompt_verify").time():
                verify_prompt_pages(self.pool, owner, alloc.epoch, alloc.leases, alloc.num_prompt_tokens,
                                    cov.num_tokens, list(cov.checksums), self.check_checksums, alloc.num_shared,
                                    alloc.plan.chains if alloc.plan is not None else None)
                if self.canary:
                    check_canaries(self.pool, alloc.leases, alloc.num_prompt_tokens)
            if not validate:
                return
            n = pages_for(alloc.num_prompt_tokens, self.pool.page_size)
            with GUARD_SECONDS.labels("validate_rpc").time():
                await self.leases.validate(owner, alloc.epoch, alloc.leases[:n],
                                           timeout_within(deadline, self.rpc_timeout_s, "before broker Validate"))
        except Violation as v:
            count_violation("decode", v.reason, owner)
            log.error("request %s refused before its first step: %s %s", owner.hex(), v.reason, v.message)
            raise PdError(grpc.StatusCode.DATA_LOSS, v.reason, v.message) from None
        except PdError as e:
            if e.reason in ("LEASE_NOT_CURRENT", "WRITER_ACTIVE"):
                count_violation("decode", e.reason, owner)
                raise PdError(grpc.StatusCode.DATA_LOSS, e.reason, e.message) from None
            if e.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                TIMEOUTS.labels("validate").inc()
            if e.reason == "EPOCH_MISMATCH":
                raise PdError(grpc.StatusCode.UNAVAILABLE, e.reason, e.message) from None
            raise

    @staticmethod
    def _finish(seq: Sequence, finished: bool) -> int:
        if not finished:
            return common_pb2.FINISH_REASON_UNSPECIFIED
        return FINISH[seq.is_stopped()]

    async def _release_seq(self, seq: Sequence) -> None:
        await self.release(seq.owner, seq.epoch, seq.leases)

    async def release(self, owner: bytes, epoch: int, leases: list[tuple[int, int]]) -> None:
        await self.grants.release(owner, epoch, leases)
