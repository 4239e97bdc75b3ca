"""Gateway gRPC servicer: admission, request ids, routing, streaming.

A client disconnect cancels only the decode stream: a prefill that has started runs to its
EndWrite, and its decode allocation is released after it.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass

import grpc

from ..common.admission import _reject
from ..common.config import pages_needed
from ..common.drain import draining_error
from ..common.errors import PdError, from_rpc_error
from ..common.metrics import ITL, REQUESTS, TIMEOUTS, TTFT
from ..common.proto import common_pb2, decode_pb2, gateway_pb2, gateway_pb2_grpc, prefill_pb2
from ..common.tasks import spawn
from ..common.deadline import deadline_exceeded, deadline_of, timeout_within
from ..common.wire import call, sampling_from_pb
from .admit import admit
from .limits import ConcurrencyLimit
from .responses import Responses
from .router import Backend, Router, Ticket

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Capacity:
    model: str
    context_length: int
    vocab_size: int
    page_size: int
    decode_pool_pages: int
    prefill_pool_tokens: int


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, prefills: Router, decodes: Router, tokenizer, cap: Capacity | None,
                 queue_limit: int = 256, queue_timeout_s: float = 30.0, rpc_timeout_s: float = 60.0,
                 token_timeout_s: float = 60.0):
        self.token_timeout_s = token_timeout_s
        # routers over the live backend sets (backends.py); cap and tokenizer arrive with the first usable pair
        self.prefills = prefills
        self.decodes = decodes
        self.tokenizer = tokenizer
        self.cap = cap
        self.queue_limit = queue_limit
        self.queue_timeout_s = queue_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self._waiting = 0
        self.draining = False  # set on SIGTERM (drain.py): Generate refuses, running streams finish
        self.active = 0  # Generate calls (gRPC and HTTP) not yet ended
        self.concurrency = ConcurrencyLimit()  # no limit unless main.py sets --max-concurrent-requests

    def _capacity(self) -> Capacity:
        if self.cap is None or self.tokenizer is None:
            raise PdError(grpc.StatusCode.UNAVAILABLE, "NO_BACKEND",
                          "the gateway has not found a prefill and a decode instance that take work yet")
        return self.cap

    async def GetModelInfo(self, request, context) -> gateway_pb2.ModelInfo:
        c = self._capacity()
        return gateway_pb2.ModelInfo(
            model=c.model, context_length=c.context_length, vocab_size=c.vocab_size, page_size=c.page_size,
            decode_pool_tokens=c.decode_pool_pages * c.page_size, prefill_pool_tokens=c.prefill_pool_tokens,
            max_prompt_tokens=min(c.prefill_pool_tokens, c.context_length - 1),
            num_prefill=len(self.prefills.backends), num_decode=len(self.decodes.backends))

    def admit(self, request) -> tuple[list[int], common_pb2.SamplingParams]:
        self._capacity()
        return admit(request, self.cap, self.tokenizer)

    async def Generate(self, request, context):
        async for msg in self.generate(request, deadline_of(context)):
            yield msg

    async def generate(self, request, deadline: float | None = None):
        """The GenerateResponses of one request. deadline (absolute time.monotonic() seconds) bounds every
        internal call: past it the request ends with DEADLINE_EXCEEDED and its pages are given back."""
        start = time.perf_counter()
        code = "OK"
        self.active += 1
        try:
            if self.draining:
                raise draining_error("gateway", "new requests are refused; send them to another gateway")
            tokens, sampling = self.admit(request)
            self.concurrency.enter(self.active)  # after admission: a request that can never fit is not told to retry
            tried: set[str] = set()
            for attempt in range(2):
                # a retryable failure before the first token is retried once, on another pair, as a new request
                request_id = secrets.token_bytes(16)
                # the Backend objects, not their addresses, carry the request: Decode reaches the pod that
                # answered Allocate whatever discovery does meanwhile (a gone backend's channel outlives it)
                need = pages_needed(len(tokens), request.max_tokens, self.cap.page_size)
                decode = self.decodes.pick(exclude=tried, pages=need)
                prefill = self.prefills.pick(exclude=tried)
                tickets = (decode.take(need), prefill.take())
                sent = 0
                try:
                    async for msg in self._run(request_id, tokens, sampling, request, prefill, decode, start,
                                               tickets, deadline):
                        sent += 1
                        yield msg
                    break
                except PdError as e:  # a backend's DRAINING refusal is UNAVAILABLE: retried, that pair excluded
                    if sent or attempt or e.code != grpc.StatusCode.UNAVAILABLE:
                        raise
                    log.warning("request %s failed before its first token (%s); retrying on another pair",
                                request_id.hex(), e)
                    tried.update((decode.target, prefill.target))
                finally:
                    decode.done(tickets[0])
                    prefill.done(tickets[1])
        except PdError as e:
            code = e.code.name
            raise
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            self.active -= 1
            REQUESTS.labels(code).inc()

    async def _run(self, request_id: bytes, tokens: list[int], sampling, request, prefill: Backend, decode: Backend,
                   start: float, tickets: tuple[Ticket, Ticket], deadline: float | None):
        alloc = asyncio.ensure_future(self._allocate(decode, request_id, len(tokens), sampling.max_tokens, deadline))
        try:
            dest = await asyncio.shield(alloc)
            Backend.settle(tickets[0])
        except asyncio.CancelledError:
            # the client left while decode was granting: once the grant lands, give it back
            alloc.add_done_callback(lambda t: None if t.cancelled() or t.exception() is not None
                                    else spawn(self._release(decode, request_id)))
            raise
        want_prompt_lps = request.HasField("prompt_logprobs")
        preq = prefill_pb2.PrefillRequest(request_id=request_id, token_ids=tokens, sampling=sampling, destination=dest,
                                          prompt_logprobs=request.prompt_logprobs if want_prompt_lps else None)
        try:
            timeout = timeout_within(deadline, self.rpc_timeout_s, "before the prefill call")
        except PdError:
            await asyncio.shield(self._release(decode, request_id))
            raise
        task = asyncio.ensure_future(call(prefill.stub.Prefill(preq, timeout=timeout), f"prefill {prefill.target}"))
        Backend.settle(tickets[1])
        try:
            resp = await asyncio.shield(task)
        except asyncio.CancelledError:
            # the client left mid-prefill: the write runs to its EndWrite, then the pages go back
            task.add_done_callback(lambda _: spawn(self._release(decode, request_id)))
            raise
        except PdError as e:
            if e.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                TIMEOUTS.labels("prefill").inc()
            # shielded: a client leaving now must not cancel the give-back and strand the allocation
            await asyncio.shield(self._release(decode, request_id))
            if e.code == grpc.StatusCode.DEADLINE_EXCEEDED and deadline is not None and time.monotonic() >= deadline:
                raise deadline_exceeded(deadline, f"during prefill ({e.message})") from None
            raise
        try:
            out = Responses(self.tokenizer, request_id, tokens, sampling, list(request.stop), resp, want_prompt_lps)
        except PdError:
            await asyncio.shield(self._release(decode, request_id))
            raise
        dreq = decode_pb2.DecodeRequest(request_id=request_id, num_prompt_tokens=len(tokens),
                                        first_token=resp.first_token, sampling=sampling, coverage=resp.coverage)
        if sampling_from_pb(sampling).repetition_penalty != 1.0:
            dreq.prompt_token_ids.extend(tokens)  # the penalty counts prompt tokens
        stream = decode.stub.Decode(dreq, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        last = None
        ended_by_decode = False
        try:
            while True:
                # a bound on each gap (and the request's deadline, if any, on the whole stream)
                gap = timeout_within(deadline, self.token_timeout_s, f"after {out.num_sent} tokens")
                try:
                    r = await asyncio.wait_for(stream.read(), gap)
                except asyncio.TimeoutError:
                    TIMEOUTS.labels("decode").inc()
                    if deadline is not None and time.monotonic() >= deadline:
                        raise deadline_exceeded(deadline, f"while waiting for token {out.num_sent}") from None
                    raise PdError(grpc.StatusCode.DEADLINE_EXCEEDED, "DECODE_STALLED",
                                  f"decode {decode.target} sent no token for {self.token_timeout_s:.0f}s") from None
                if r is grpc.aio.EOF:
                    ended_by_decode = True
                    break
                now = time.perf_counter()
                first = last is None
                if first:
                    TTFT.observe(now - start)
                else:
                    ITL.observe(now - last)
                last = now
                yield out.make(r)
                if out.stopped:
                    break  # a stop string: the decode stream is cancelled and its pages released below
        except grpc.RpcError as e:
            # not "ended by decode": an UNAVAILABLE call may never have reached it, so Release below
            err = from_rpc_error(e)
            if err.code == grpc.StatusCode.DEADLINE_EXCEEDED and deadline is not None:
                raise deadline_exceeded(deadline, f"decode {decode.target}: {err.message}") from None
            raise PdError(err.code, err.reason, f"decode {decode.target}: {err.message}") from None
        finally:
            stream.cancel()
            if not ended_by_decode:
                # the client left, decode stalled or the call failed: it may not even have reached decode,
                # whose allocation would then wait for its timeout; Release is idempotent
                spawn(self._release(decode, request_id))

    async def _allocate(self, decode: Backend, request_id: bytes, num_prompt: int, max_tokens: int,
                        request_deadline: float | None):
        """Allocates decode pages; when the pool is full right now, waits in a bounded queue."""
        req = decode_pb2.AllocateRequest(request_id=request_id, num_prompt_tokens=num_prompt, max_tokens=max_tokens)
        deadline = time.monotonic() + self.queue_timeout_s
        queued = False
        delay = 0.005
        try:
            while True:
                try:
                    timeout = timeout_within(request_deadline, 10.0, "before decode Allocate (waiting for KV pages)")
                    resp = await call(decode.stub.Allocate(req, timeout=timeout), f"decode {decode.target}")
                    return resp.destination
                except PdError as e:
                    if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise
                    if not queued:
                        if self._waiting >= self.queue_limit:
                            raise _reject("OVERLOADED", f"{self._waiting} requests already wait for KV pages "
                                                        f"(limit {self.queue_limit})") from None
                        self._waiting += 1
                        queued = True
                    if time.monotonic() + delay > deadline:
                        TIMEOUTS.labels("queue").inc()
                        raise PdError(grpc.StatusCode.RESOURCE_EXHAUSTED, "QUEUE_TIMEOUT",
                                      f"no KV pages freed within {self.queue_timeout_s:.0f}s: {e.message}") from None
                    # never past the request's deadline: the next attempt then ends it with DEADLINE_EXCEEDED
                    await asyncio.sleep(delay if request_deadline is None else
                                        max(0.0, min(delay, request_deadline - time.monotonic())))
                    delay = min(delay * 2, 0.1)
        finally:
            if queued:
                self._waiting -= 1

    async def _release(self, decode: Backend, request_id: bytes) -> None:
        try:
            await decode.stub.Release(decode_pb2.DecodeReleaseRequest(request_id=request_id), timeout=10)
        except grpc.RpcError as e:
            log.warning("release of %s on %s failed: %s", request_id.hex(), decode.target, e.code())
