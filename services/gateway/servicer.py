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

from ..common.admission import _reject, check_lengths, check_sampling, check_tokens
from ..common.config import pages_needed
from ..common.drain import draining_error
from ..common.errors import PdError, from_rpc_error
from ..common.metrics import ITL, REQUESTS, TIMEOUTS, TTFT
from ..common.proto import common_pb2, decode_pb2, gateway_pb2, gateway_pb2_grpc, prefill_pb2
from ..common.tasks import spawn
from ..common.wire import call
from ..engine.tokenizer import IncrementalDecoder
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

    def admit(self, request) -> list[int]:
        """DESIGN §4, before any lease, allocation or transfer."""
        self._capacity()
        top_p = request.top_p if request.HasField("top_p") else 1.0
        check_sampling(request.max_tokens, request.temperature, top_p)
        # the O(1) length checks first: an over-long flood never pays for copying its ids or a vocabulary scan
        ids = request.prompt_token_ids
        if len(ids):
            self._check_lengths(len(ids), request.max_tokens)
            tokens = list(ids)
        else:
            tokens = self.tokenizer.encode(request.prompt)
            if tokens:
                self._check_lengths(len(tokens), request.max_tokens)
        check_tokens(tokens, self.cap.vocab_size)
        return tokens

    def _check_lengths(self, num_prompt: int, max_tokens: int) -> None:
        c = self.cap
        check_lengths(num_prompt, max_tokens, c.context_length, c.page_size, c.decode_pool_pages,
                      c.prefill_pool_tokens)

    def generate(self, request, deadline=None):
        return self.Generate(request, None)

    async def Generate(self, request, context):
        start = time.perf_counter()
        code = "OK"
        self.active += 1
        try:
            if self.draining:
                raise draining_error("gateway", "new requests are refused; send them to another gateway")
            tokens = self.admit(request)
            sampling = common_pb2.SamplingParams(
                temperature=request.temperature, top_p=request.top_p if request.HasField("top_p") else 1.0,
                seed=request.seed if request.HasField("seed") else secrets.randbits(63),
                max_tokens=request.max_tokens, ignore_eos=request.ignore_eos)
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
                    async for msg in self._run(request_id, tokens, sampling, prefill, decode, start, tickets):
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

    async def _run(self, request_id: bytes, tokens: list[int], sampling, prefill: Backend, decode: Backend,
                   start: float, tickets: tuple[Ticket, Ticket]):
        alloc = asyncio.ensure_future(self._allocate(decode, request_id, len(tokens), sampling.max_tokens))
        try:
            dest = await asyncio.shield(alloc)
            Backend.settle(tickets[0])
        except asyncio.CancelledError:
            # the client left while decode was granting: once the grant lands, give it back
            alloc.add_done_callback(lambda t: None if t.cancelled() or t.exception() is not None
                                    else spawn(self._release(decode, request_id)))
            raise
        task = asyncio.ensure_future(call(prefill.stub.Prefill(prefill_pb2.PrefillRequest(
            request_id=request_id, token_ids=tokens, sampling=sampling, destination=dest),
            timeout=self.rpc_timeout_s), f"prefill {prefill.target}"))
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
            raise
        stream = decode.stub.Decode(decode_pb2.DecodeRequest(
            request_id=request_id, num_prompt_tokens=len(tokens), first_token=resp.first_token,
            sampling=sampling, coverage=resp.coverage))
        text = IncrementalDecoder(self.tokenizer)
        last = None
        ended_by_decode = False
        try:
            while True:
                # no deadline on the whole stream (generations can be long), but a bound on each gap
                try:
                    r = await asyncio.wait_for(stream.read(), self.token_timeout_s)
                except asyncio.TimeoutError:
                    TIMEOUTS.labels("decode").inc()
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
                piece = text.push([r.token_id])
                if r.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    piece += text.flush()  # the last token: nothing may stay held back
                yield gateway_pb2.GenerateResponse(
                    request_id=request_id if first else b"", token_ids=[r.token_id],
                    text=piece, finish_reason=r.finish_reason, prompt_tokens=len(tokens))
        except grpc.RpcError as e:
            # not "ended by decode": an UNAVAILABLE call may never have reached it, so Release below
            err = from_rpc_error(e)
            raise PdError(err.code, err.reason, f"decode {decode.target}: {err.message}") from None
        finally:
            stream.cancel()
            if not ended_by_decode:
                # the client left, decode stalled or the call failed: it may not even have reached decode,
                # whose allocation would then wait for its timeout; Release is idempotent
                spawn(self._release(decode, request_id))

    async def _allocate(self, decode: Backend, request_id: bytes, num_prompt: int, max_tokens: int):
        """Allocates decode pages; when the pool is full right now, waits in a bounded queue."""
        req = decode_pb2.AllocateRequest(request_id=request_id, num_prompt_tokens=num_prompt, max_tokens=max_tokens)
        deadline = time.monotonic() + self.queue_timeout_s
        queued = False
        delay = 0.005
        try:
            while True:
                try:
                    resp = await call(decode.stub.Allocate(req, timeout=10.0), f"decode {decode.target}")
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
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.1)
        finally:
            if queued:
                self._waiting -= 1

    async def _release(self, decode: Backend, request_id: bytes) -> None:
        try:
            await decode.stub.Release(decode_pb2.DecodeReleaseRequest(request_id=request_id), timeout=10)
        except grpc.RpcError as e:
            log.warning("release of %s on %s failed: %s", request_id.hex(), decode.target, e.code())
