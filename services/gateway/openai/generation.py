"""From an OpenAI request to gateway Generate calls and back: one call per (prompt, choice), run side by side
on the same admission and streaming path as gRPC; a client that leaves cancels every call it started."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

from fastapi import Request

from ...common.admission import MAX_LOGIT_BIAS
from ...common.errors import PdError
from ...common.proto import common_pb2, gateway_pb2
from ...common.token_ids import parse_token_id
from .errors import ApiError
from .schema import Sampling

log = logging.getLogger(__name__)

FINISH = {common_pb2.FINISH_REASON_LENGTH: "length", common_pb2.FINISH_REASON_STOP: "stop"}


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


def logit_bias_of(body: Sampling, vocab_size: int) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as strings (common/token_ids.py says which spellings); the
    count is checked before any key is read."""
    bias = body.logit_bias or {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, "invalid_value", f"{len(bias)} logit_bias entries; at most {MAX_LOGIT_BIAS}",
                       param="logit_bias")
    out = {}
    for k, v in bias.items():
        try:
            out[parse_token_id(k, vocab_size)] = v
        except ValueError as e:
            raise ApiError(400, "invalid_value", f"logit_bias key {e}", param="logit_bias") from None
    return out


def grammar_of(body: Sampling) -> tuple[str, bool]:
    """(json_schema, json_object) of the body's response_format."""
    try:
        return body.grammar()
    except ValueError as e:
        raise ApiError(400, "invalid_value", str(e), param="response_format") from None


def build(body: Sampling, prompt: str | list[int], max_tokens: int, choice: int, logprobs: int | None,
          prompt_logprobs: int | None, logit_bias: dict[int, float],
          grammar: tuple[str, bool] | None = None) -> gateway_pb2.GenerateRequest:
    """Choice i of a request with a seed samples with seed + i, so n > 1 gives n different, reproducible
    choices. logit_bias: logit_bias_of(body), read once for every choice. grammar: (json_schema, json_object) to
    enforce; None: the body's response_format."""
    json_schema, json_object = grammar if grammar is not None else grammar_of(body)
    req = gateway_pb2.GenerateRequest(
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, ignore_eos=body.ignore_eos,
        frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty, stop=body.stops(),
        stop_token_ids=body.stop_token_ids)
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.extend(prompt)
    if body.top_k:
        req.top_k = body.top_k
    if body.repetition_penalty is not None:
        req.repetition_penalty = body.repetition_penalty
    if body.seed is not None:
        req.seed = (body.seed + choice) % 2**64
    if logprobs is not None:
        req.logprobs = logprobs
    if prompt_logprobs is not None:
        req.prompt_logprobs = prompt_logprobs
    if body.cache_salt is not None:
        req.cache_salt = body.cache_salt
    req.logit_bias.update(logit_bias)
    if body.min_p:
        req.min_p = body.min_p
    req.min_tokens = body.min_tokens
    req.json_schema, req.json_object = json_schema, json_object
    return req


def tenant_of(request: Request) -> str | None:
    """The tenant the Envelope found for the caller's key; None (refused by the servicer when it has keys) if the
    request never passed the Envelope."""
    return getattr(request.state, "tenant", None)


@dataclass
class Output:
    """One choice's messages gathered: tokens, text, logprobs, and the prompt as the first message gave it."""
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish: str | None = None
    prompt_tokens: int = 0
    prompt_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)

    def add(self, r: gateway_pb2.GenerateResponse) -> None:
        self.token_ids.extend(r.token_ids)
        self.text.append(r.text)
        self.logprobs.extend(r.logprobs)
        self.finish = FINISH.get(r.finish_reason, self.finish)
        self.prompt_tokens = r.prompt_tokens or self.prompt_tokens
        self.prompt_ids.extend(r.prompt_token_ids)
        self.prompt_logprobs.extend(r.prompt_logprobs)


# the official client's read timeout, sent with every request: for an answer that comes in one piece (not
# streamed) it is the client's deadline, since it reads nothing before the whole answer
READ_TIMEOUT = "x-stainless-read-timeout"


def client_deadline(request: Request) -> float | None:
    """The time.monotonic() after which the client of a non-streamed request no longer waits, or None."""
    raw = request.headers.get(READ_TIMEOUT)
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ApiError(400, "invalid_header", f"header {READ_TIMEOUT} must be a positive number of seconds, got {raw[:40]!r}",
                       param=READ_TIMEOUT)
    return time.monotonic() + seconds


class Merged:
    """(choice index, message) from all calls as they arrive; the first error ends them all. Close it (aclose, or
    contextlib.aclosing) so that the calls are cancelled with it. deadline (time.monotonic()) bounds every internal
    call of every choice; tenant: the caller's (tenant_of). ready() hands over, without waiting, what has already
    arrived, so a reader that fell behind writes it in one go.

    what: the request as its log line names it. A request that was admitted (a message arrived) gets one INFO line
    when it is closed, off the path of its first token: its internal request ids, tokens, time to the first message
    and in all, and how it ended; one refused before any message gets none (a flood of refusals must not cost a
    line each)."""

    def __init__(self, servicer, reqs: list[gateway_pb2.GenerateRequest], rid: str, deadline: float | None = None,
                 tenant: str | None = None, what: str = "generate"):
        self._servicer, self._reqs, self._rid, self._deadline, self._tenant = servicer, reqs, rid, deadline, tenant
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Future] | None = None  # the calls start at the first read
        self._left = len(reqs)  # calls that have not ended
        self._error: Exception | None = None  # arrived behind messages ready() handed over: raised next
        self._what, self._start = what, time.perf_counter()
        self._first: float | None = None  # when the first message arrived
        self._internal: list[tuple[int, str]] = []  # (choice, internal request id)
        self._tokens = 0
        self._ended: str | None = None  # "ok" once every call ended; else the first error's name

    async def _pump(self, i: int, req) -> None:
        try:
            async for r in self._servicer.generate(req, self._deadline, self._tenant):
                if self._first is None:
                    self._first = time.perf_counter()
                if r.request_id:
                    self._internal.append((i, r.request_id.hex()))
                    log.debug("http request %s choice %d: internal request %s", self._rid, i, r.request_id.hex())
                self._tokens += len(r.token_ids)
                self._queue.put_nowait((i, r))
            self._queue.put_nowait((i, None))
        except Exception as e:  # handed to the reader, which raises it
            if self._ended is None:
                self._ended = f"{e.code.name} {e.reason}" if isinstance(e, PdError) else type(e).__name__
            self._queue.put_nowait((i, e))

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, gateway_pb2.GenerateResponse]:
        if self._tasks is None:
            self._tasks = [asyncio.ensure_future(self._pump(i, req)) for i, req in enumerate(self._reqs)]
        while True:
            if self._error is not None:
                raise self._error
            if not self._left:
                raise StopAsyncIteration
            i, item = await self._queue.get()
            if item is None:
                self._left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                return i, item

    def ready(self) -> list[tuple[int, gateway_pb2.GenerateResponse]]:
        """The messages already queued, in order, without waiting; an error behind them is raised by the next
        read."""
        out = []
        while self._error is None and not self._queue.empty():
            i, item = self._queue.get_nowait()
            if item is None:
                self._left -= 1
            elif isinstance(item, Exception):
                self._error = item
            else:
                out.append((i, item))
        return out

    async def aclose(self) -> None:
        tasks, self._tasks = self._tasks or [], []
        ended = self._ended or ("ok" if not self._left else "cancelled")
        self._left, self._error = 0, None
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if tasks and self._first is not None:
            self._log_end(ended)

    def _log_end(self, ended: str) -> None:
        now = time.perf_counter()
        log.info("http request %s: %s; internal %s; %d tokens, first message at %.1f ms, %.1f ms in all; %s",
                 self._rid, self._what, " ".join(f"{i}:{h}" for i, h in self._internal) or "-", self._tokens,
                 (self._first - self._start) * 1e3, (now - self._start) * 1e3, ended)


def merged(servicer, reqs: list[gateway_pb2.GenerateRequest], rid: str, deadline: float | None = None,
           tenant: str | None = None, what: str = "generate") -> Merged:
    return Merged(servicer, reqs, rid, deadline, tenant, what)


async def _gather(servicer, reqs, rid: str, deadline: float | None, tenant: str | None, what: str) -> list[Output]:
    outs = [Output() for _ in reqs]
    gen = merged(servicer, reqs, rid, deadline, tenant, what)
    try:
        async for i, r in gen:
            outs[i].add(r)
    finally:
        await gen.aclose()
    return outs


async def _disconnected(request: Request) -> None:
    # the body is read: the next ASGI message is the disconnect (or the end once the response is sent)
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work, rid: str):
    """Awaits work while watching the connection: a client that leaves cancels it (and the calls it runs)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone):
            if not t.done():
                t.cancel()
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        log.info("http request %s: the client left; its generate calls are cancelled", rid)
        raise ClientGone(rid)
    return task.result()


async def collect(servicer, reqs, request: Request, rid: str, what: str = "generate") -> list[Output]:
    """Runs every call to its end, unless the client leaves first or its deadline passes. what: for the log line
    (Merged)."""
    return await until_disconnect(
        request, _gather(servicer, reqs, rid, client_deadline(request), tenant_of(request), what), rid)
