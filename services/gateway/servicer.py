"""Gateway gRPC servicer: admission, tenants and prefix scopes, request ids, routing, streaming.

A client disconnect cancels only the decode stream: a prefill that has started runs to its
EndWrite, and its decode allocation is released after it.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field

import grpc

from ..common.admission import start_grammar
from ..common.config import pages_up_front
from ..common.drain import draining_error
from ..common.errors import PdError, from_rpc_error
from ..common.metrics import GENERATION_TOKENS, ITL, PROMPT_TOKENS, REQUESTS, RESUBMISSIONS, TIMEOUTS, TTFT
from ..common.proto import common_pb2, decode_pb2, gateway_pb2, gateway_pb2_grpc, prefill_pb2
from ..common.deadline import deadline_exceeded, deadline_of, timeout_within
from ..common.wire import call, prompt_digest, sampling_from_pb
from .admit import admit
from .affinity import route_keys
from .api_key import refused
from .keys import NO_KEYS_TENANT, ApiKeys
from .limits import ConcurrencyLimit
from .responses import Responses
from .router import Backend, Router, Ticket
from .scope import Scoping

log = logging.getLogger(__name__)

# decode's reasons for ending a stream it could continue elsewhere, with tokens_streamed: the pool ran dry, or the
# drain timeout ended while it ran
HANDED_BACK = ("PREEMPTED", "DRAINED")


@dataclass(slots=True)
class Capacity:
    model: str
    context_length: int
    vocab_size: int
    page_size: int
    decode_pool_pages: int
    prefill_pool_tokens: int


@dataclass(slots=True)
class _Stream:
    """What the client has been sent across the submissions of one request (a preempted one is resubmitted)."""
    ids: list[int] = field(default_factory=list)  # token ids streamed
    out: Responses | None = None
    last: float | None = None  # when the last token went out
    resubmissions: int = 0
    resubmitted_at: int = 0  # len(ids) when the current submission went out: decode counts from there
    decode: str = ""  # the decode the current submission runs on
    avoid: set[str] = field(default_factory=set)  # decodes that handed the request back draining: never again
    scope: bytes = b""  # the request's prefix scope (scope.py), the same for every submission; b"": no reuse


def _retrieve(task: asyncio.Future) -> None:
    """A prefill call nobody awaits any more (the first token came first, or the request ended): its outcome is
    read so that it is not reported as never retrieved."""
    if not task.cancelled():
        task.exception()


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    grammars = None  # structured output's compiler (engine/grammar.Grammars), set once the vocabulary is known

    def __init__(self, prefills: Router, decodes: Router, tokenizer, cap: Capacity | None,
                 rpc_timeout_s: float = 60.0, token_timeout_s: float = 60.0, notice_timeout_s: float = 5.0,
                 max_resubmissions: int = 3, prefill_timeout_per_token_s: float = 0.005,
                 keys: ApiKeys | None = None, scoping: Scoping = Scoping()):
        self.token_timeout_s = token_timeout_s
        # a prompt's forward pass grows with its length: the prefill bound (and the wait for its first token) is
        # rpc_timeout_s + this per prompt token, so a 1M-token prompt is not cut off by a bound sized for 4k
        self.prefill_timeout_per_token_s = prefill_timeout_per_token_s
        self.max_resubmissions = max_resubmissions
        # routers over the live backend sets (backends.py); cap and tokenizer arrive with the first usable pair
        self.prefills = prefills
        self.decodes = decodes
        self.tokenizer = tokenizer
        self.cap = cap
        self.rpc_timeout_s = rpc_timeout_s
        self.notice_timeout_s = notice_timeout_s
        self.draining = False  # set on SIGTERM (drain.py): Generate refuses, running streams finish
        self.active = 0  # Generate calls (gRPC and HTTP) not yet ended
        self.streaming = 0  # of those, the ones that have streamed a first token
        self.concurrency = ConcurrencyLimit()  # no limit unless main.py sets --max-concurrent-requests
        self.keys = keys  # None: no API key, every caller is of one tenant
        self.scoping = scoping

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
        tenant = NO_KEYS_TENANT
        if self.keys is not None:
            # the interceptor let the call in; the tenant is read here again, and a call that got past without a
            # key (a server built without the interceptor) is refused rather than served as nobody's
            tenant = self.keys.tenant_of_metadata(context.invocation_metadata())
            if tenant is None:
                raise refused()
        async for msg in self.generate(request, deadline_of(context), tenant):
            yield msg

    def load(self) -> tuple[int, int]:
        """(running, waiting) for pdserve_requests_running/_waiting: generations streaming tokens, and generations
        admitted or being admitted that have not streamed a first token yet."""
        return self.streaming, self.active - self.streaming

    def tenant_or_refuse(self, tenant: str | None) -> str:
        if tenant is not None:
            return tenant
        if self.keys is not None:
            raise refused()  # the caller's key was never looked up: fail closed
        return NO_KEYS_TENANT

    async def generate(self, request, deadline: float | None = None, tenant: str | None = None):
        """The GenerateResponses of one request. deadline (absolute time.monotonic() seconds) bounds every
        internal call: past it the request ends with DEADLINE_EXCEEDED and its pages are given back. tenant: the
        caller's API key's tenant (keys.py); it and request.cache_salt decide the prefix scope.

        A request decode hands back (UNAVAILABLE, carrying how many tokens it streamed: PREEMPTED when its pool
        ran dry, DRAINED when it was still running at the end of decode's drain timeout) is resubmitted as
        prompt + the tokens streamed so far, through prefill, with max_tokens what is left, and its stream goes
        on where it stopped: no token twice, none missing (at most --max-resubmissions times; then the client
        gets the error). A drained request goes to another decode, never back to the draining one; with no other
        decode taking work the client gets UNAVAILABLE DRAINED saying so. Greedy output is the same as without
        the hand-back; a sampled one draws its later tokens afresh, and frequency/presence penalties count the
        tokens before it as prompt tokens."""
        start = time.perf_counter()
        code = "OK"
        client = None
        self.active += 1
        try:
            if self.draining:
                raise draining_error("gateway", "new requests are refused; send them to another gateway")
            tenant = self.tenant_or_refuse(tenant)
            tokens, sampling = self.admit(request)
            # a grammar the library cannot compile is refused here, in its words, before any page is leased
            await start_grammar(self.grammars, sampling_from_pb(sampling).grammar)
            scope = self.scoping.scope_of(tenant, request.cache_salt)
            self.concurrency.enter(self.active)  # after admission: a request that can never fit is not told to retry
            client = _Stream(scope=scope)
            while True:
                try:
                    async for msg in self._attempts(tokens, sampling, request, start, deadline, client):
                        yield msg
                    break
                except PdError as e:
                    self._resubmittable(e, tokens, request, client)
                RESUBMISSIONS.labels("resubmitted").inc()
                client.resubmissions += 1
        except PdError as e:
            code = e.code.name
            raise
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            self.active -= 1
            if client is not None and client.last is not None:
                self.streaming -= 1
            REQUESTS.labels(code).inc()

    def _resubmittable(self, e: PdError, tokens: list[int], request, client: "_Stream") -> None:
        """Returns when a request decode handed back (HANDED_BACK) is to be resubmitted; raises what the client
        gets otherwise."""
        if e.reason not in HANDED_BACK or not client.ids:
            raise e
        said, got = e.metadata.get("tokens_streamed"), len(client.ids) - client.resubmitted_at
        if said != str(got):
            # decode and the gateway disagree on what the client has: continuing could skip or repeat a token
            raise PdError(grpc.StatusCode.INTERNAL, f"{e.reason}_MISMATCH",
                          f"decode handed the request back ({e.reason}) after {said} tokens; the gateway streamed "
                          f"{got} of this submission ({len(client.ids)} in all)") from None
        if e.reason == "DRAINED":
            client.avoid.add(client.decode)
            if not any(b.target not in client.avoid for b in self.decodes.backends):
                RESUBMISSIONS.labels("gave_up").inc()
                raise e.prefixed(f"not resubmitted after {len(client.ids)} tokens: no other decode instance takes "
                                 f"work ({len(self.decodes.all)} known, {len(self.decodes.backends)} ready, "
                                 f"{len(client.avoid)} draining under this request); retry the request") from None
        if client.resubmissions >= self.max_resubmissions:
            RESUBMISSIONS.labels("gave_up").inc()
            raise e.prefixed(f"handed back {client.resubmissions + 1} times (limit --max-resubmissions "
                             f"{self.max_resubmissions})") from None
        if len(tokens) + len(client.ids) > self.cap.prefill_pool_tokens:
            RESUBMISSIONS.labels("gave_up").inc()
            raise e.prefixed(f"prompt {len(tokens)} + {len(client.ids)} streamed tokens exceed the prefill pool of "
                             f"{self.cap.prefill_pool_tokens}: not resubmitted") from None
        log.warning("request handed back (%s) after %d of %d tokens (%s); resubmitting prompt + those tokens",
                    e.reason, len(client.ids), request.max_tokens, e.message)

    async def _attempts(self, tokens: list[int], sampling, request, start: float, deadline: float | None,
                        client: "_Stream"):
        """One submission (prompt + what was streamed before it): a retryable failure before its first token is
        retried once, on another pair, as a new request."""
        client.resubmitted_at = len(client.ids)
        if client.ids:  # a resubmission: prefill computes what follows the tokens the client already has
            tokens = tokens + client.ids
            left = common_pb2.SamplingParams()
            left.CopyFrom(sampling)
            left.max_tokens = sampling.max_tokens - len(client.ids)
            left.min_tokens = max(0, sampling.min_tokens - len(client.ids))
            if sampling.json_schema or sampling.json_object:  # the grammar goes on from where the output is
                left.grammar_prefix[:] = client.ids
            sampling = left
        tried: set[str] = set(client.avoid)
        prefix = route_keys(client.scope, tokens, self.cap.page_size)
        for attempt in range(2):
            request_id = secrets.token_bytes(16)
            # the Backend objects, not their addresses, carry the request: Decode reaches the pod that
            # answered Allocate whatever discovery does meanwhile (a gone backend's channel outlives it)
            need = pages_up_front(len(tokens), sampling.max_tokens, self.cap.page_size)
            decode = self.decodes.pick(exclude=tried, pages=need, prefix=prefix)
            prefill = self.prefills.pick(exclude=tried, prefix=prefix)
            client.decode = decode.target
            tickets = (decode.take(need), prefill.take())
            sent = len(client.ids)
            try:
                async for msg in self._run(request_id, tokens, sampling, request, prefill, decode, start,
                                           tickets, deadline, client):
                    yield msg
                return
            except PdError as e:  # a backend's DRAINING refusal is UNAVAILABLE: retried, that pair excluded
                # the client's error names the submission that failed and its pair (ErrorInfo.metadata): the id
                # every service logs the request under, and the pair's addresses its message already names
                e.metadata.update(request_id=request_id.hex(), prefill=prefill.target, decode=decode.target)
                if len(client.ids) > sent or attempt or e.code != grpc.StatusCode.UNAVAILABLE \
                        or e.reason in HANDED_BACK:
                    raise
                log.warning("request %s failed before its first token (%s); retrying on another pair",
                            request_id.hex(), e)
                tried.update((decode.target, prefill.target))
            finally:
                decode.done(tickets[0])
                prefill.done(tickets[1])

    async def _run(self, request_id: bytes, tokens: list[int], sampling, request, prefill: Backend, decode: Backend,
                   start: float, tickets: tuple[Ticket, Ticket], deadline: float | None, client: "_Stream"):
        """Three round trips to the first token: decode's Run stream grants pages (waiting in decode's queue when
        the pool is full) and sends the destination; prefill writes there and acks to the broker; the broker's
        write-done notice starts decode, whose first token comes down the same stream."""
        run = decode_pb2.RunRequest(request_id=request_id, num_prompt_tokens=len(tokens), sampling=sampling,
                                    prompt_digest=prompt_digest(tokens), prefix_scope=client.scope,
                                    handed_back=client.resubmissions)
        # the penalty counts prompt tokens; a scope's chain is computed by decode from the ids themselves
        if client.scope or sampling_from_pb(sampling).repetition_penalty != 1.0:
            run.prompt_token_ids.extend(tokens)
        stream = decode.stub.Run(run, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        pf = None
        try:
            ev = await self._next(stream, decode, deadline, "before decode granted KV pages")
            if ev is None or not ev.HasField("destination"):
                raise PdError(grpc.StatusCode.INTERNAL, "BAD_STREAM", f"decode {decode.target} sent no destination")
            Backend.settle(tickets[0])
            want_prompt_lps = request.HasField("prompt_logprobs") and not client.ids
            preq = prefill_pb2.PrefillRequest(request_id=request_id, token_ids=tokens, sampling=sampling,
                                              destination=ev.destination, prefix_scope=client.scope,
                                              prompt_logprobs=request.prompt_logprobs if want_prompt_lps else None)
            bound = self.rpc_timeout_s + len(tokens) * self.prefill_timeout_per_token_s
            timeout = timeout_within(deadline, bound, "before the prefill call")
            # cancelled only if the client leaves: prefill then drops the work if its forward pass has not begun,
            # and otherwise writes to its EndWrite (decode's release meanwhile only quarantines the pages)
            pf = asyncio.ensure_future(call(prefill.stub.Prefill(preq, timeout=timeout), f"prefill {prefill.target}"))
            pf.add_done_callback(_retrieve)
            Backend.settle(tickets[1])
            first = asyncio.ensure_future(self._next(stream, decode, deadline, "waiting for the first token",
                                                     max(self.token_timeout_s, bound)))
            try:
                await asyncio.wait({pf, first}, return_when=asyncio.FIRST_COMPLETED)
                if pf.done() and pf.exception() is not None:
                    # the request's deadline, not the call's own bound, set the prefill call's timeout
                    raise self._prefill_error(pf.exception(), deadline, timeout < bound)
                if not pf.done() and isinstance(first.exception(), PdError) and \
                        first.exception().code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    TIMEOUTS.labels("prefill").inc()
                    raise deadline_exceeded(deadline, "during prefill") if deadline is not None else first.exception()
                if not first.done():
                    # prefill's EndWrite was answered before it replied: the notice is on its way to decode, unless
                    # the ack was lost, and then the pages wait for the writer's liveness to lapse (retryable)
                    await asyncio.wait({first}, timeout=self.notice_timeout_s)
                    if not first.done():
                        raise PdError(grpc.StatusCode.UNAVAILABLE, "NO_WRITE_NOTICE",
                                      f"prefill {prefill.target} reported the KV written, but decode {decode.target} "
                                      f"sent no token within {self.notice_timeout_s:g}s of it (the broker's "
                                      f"write-done notice did not come: an EndWrite lost?)")
                r = await first
                # log-probabilities of the first token and of the prompt come from prefill's answer
                resp = await pf if (sampling.HasField("logprobs") or want_prompt_lps) else prefill_pb2.PrefillResponse()
            finally:
                first.cancel()
            if r is None:
                raise PdError(grpc.StatusCode.INTERNAL, "BAD_STREAM", f"decode {decode.target} ended the stream "
                                                                      "without a token")
            if client.out is None:
                client.out = Responses(self.tokenizer, request_id, tokens, sampling, list(request.stop), resp,
                                       want_prompt_lps)
            else:
                client.out.resume(resp)  # the stream goes on: text, stop strings and counts where they were
            out = client.out
            while r is not None:
                now = time.perf_counter()
                if client.last is None:
                    TTFT.observe(now - start)
                    PROMPT_TOKENS.inc(len(tokens))  # the first submission's: the client's prompt
                    self.streaming += 1
                else:
                    ITL.observe(now - client.last)
                client.last = now
                msg = out.make(r.token)
                client.ids.append(r.token.token_id)
                GENERATION_TOKENS.inc()
                yield msg
                if out.stopped:
                    break  # a stop string: the stream is cancelled below, and decode releases the pages
                r = await self._next(stream, decode, deadline, f"after {out.num_sent} tokens")
        except asyncio.CancelledError:
            if pf is not None:
                pf.cancel()
            raise
        except PdError:
            if pf is not None and not pf.done():
                pf.cancel()
            raise
        finally:
            stream.cancel()  # ends the request at decode, which gives its pages back

    def _prefill_error(self, e: BaseException, deadline: float | None, by_deadline: bool) -> BaseException:
        if isinstance(e, PdError) and e.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            TIMEOUTS.labels("prefill").inc()
            # by_deadline rather than comparing the clock: a timer may fire a clock tick before the deadline
            if deadline is not None and (by_deadline or time.monotonic() >= deadline):
                return deadline_exceeded(deadline, f"during prefill ({e.message})")
        return e

    async def _next(self, stream, decode: Backend, deadline: float | None, when: str, bound: float | None = None):
        """The stream's next event (None at its end), within the gap bound (token_timeout_s unless given) and the
        request's deadline."""
        bound = self.token_timeout_s if bound is None else bound
        gap = timeout_within(deadline, bound, when)
        by_deadline = gap < bound  # the request's deadline, not the gap bound, is what ends the wait
        try:
            # a timeout scope, not wait_for: no task made per token
            async with asyncio.timeout(gap):
                r = await stream.read()
        except TimeoutError:
            TIMEOUTS.labels("decode").inc()
            if by_deadline:
                raise deadline_exceeded(deadline, when) from None
            raise PdError(grpc.StatusCode.DEADLINE_EXCEEDED, "DECODE_STALLED",
                          f"decode {decode.target} sent nothing for {bound:.0f}s ({when})") from None
        except grpc.RpcError as e:
            err = from_rpc_error(e)
            if err.code == grpc.StatusCode.DEADLINE_EXCEEDED and deadline is not None:
                raise deadline_exceeded(deadline, f"decode {decode.target} {when}: {err.message}") from None
            raise err.prefixed(f"decode {decode.target}") from None
        return None if r is grpc.aio.EOF else r
