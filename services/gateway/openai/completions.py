"""POST /v1/completions: a prompt or a batch of prompts (text or token ids), n choices each, JSON or SSE,
with echo and logprobs in the legacy completions format (tokens, token_logprobs, top_logprobs, text_offset).
Beyond OpenAI, each choice carries its `token_ids` (as vLLM's return_token_ids)."""
from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from ..admit import check_length_bound
from .body import parse, read_body
from .errors import ApiError
from .generation import Output, build, collect, logit_bias_of
from .schema import CompletionRequest
from .stream import event_stream, open_stream, usage, usage_fields

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_CHOICES = 64  # prompts x n: one request must not fan out into more generate calls than this


def prompts_of(body: CompletionRequest) -> list:
    p = body.prompt
    if isinstance(p, str) or isinstance(p[0], int):
        return [p]
    return list(p)


def logprobs_of(tok, entries: list, offset: int) -> tuple[dict, int]:
    """entries: (token id, Logprobs or None for the prompt's first token); offset: where the first token's
    text starts in the choice's text."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, lp in entries:
        s = tok.decode([t])
        out["tokens"].append(s)
        out["text_offset"].append(offset)
        offset += len(s)
        out["token_logprobs"].append(None if lp is None else lp.logprob)
        out["top_logprobs"].append(None if lp is None else {
            tok.decode([i]): v for i, v in zip(lp.top_token_ids, lp.top_logprobs)})
    return out, offset


def prompt_entries(ids: list[int], lps: list) -> list:
    return list(zip(ids, [None, *lps]))


class Choices:
    """Per-choice state while a response is built: echoed prompt text, text offsets, token counts."""

    def __init__(self, front, body: CompletionRequest, prompts: list):
        self.tok = front.servicer.tokenizer
        self.body, self.prompts, self.n = body, prompts, body.n
        self.offsets = [0] * (len(prompts) * body.n)
        self.started = [False] * len(self.offsets)
        self.prompt_tokens = [0] * len(prompts)
        self.completion_tokens = 0

    def prompt_text(self, i: int) -> str:
        p = self.prompts[i // self.n]
        return p if isinstance(p, str) else self.tok.decode(p)

    def choice(self, i: int, o: Output) -> dict:
        """The part of choice i that o (all of it, or one message of a stream) adds."""
        text, entries = "".join(o.text), list(zip(o.token_ids, o.logprobs))
        self.prompt_tokens[i // self.n] = o.prompt_tokens or self.prompt_tokens[i // self.n]
        self.completion_tokens += len(o.token_ids)
        if self.body.echo and not self.started[i]:
            text = self.prompt_text(i) + text
            entries = prompt_entries(o.prompt_ids, o.prompt_logprobs) + entries
        self.started[i] = True
        logprobs = None
        if self.body.logprobs is not None:
            logprobs, self.offsets[i] = logprobs_of(self.tok, entries, self.offsets[i])
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": o.finish,
                "token_ids": o.token_ids}

    def usage(self) -> dict:
        return usage(sum(self.prompt_tokens), self.completion_tokens)


async def handle(front, request: Request) -> Response:
    rid = request.state.request_id
    body = parse(await read_body(request, front.limits.max_body_bytes, front.limits.body_timeout_s),
                 CompletionRequest)
    front.check(body)
    prompts = prompts_of(body)
    if len(prompts) * body.n > MAX_CHOICES:
        raise ApiError(400, "too_many_choices", f"{len(prompts)} prompts x n {body.n} = {len(prompts) * body.n} "
                                                f"choices; the limit is {MAX_CHOICES}", param="n")
    bias = logit_bias_of(body, front.servicer.cap.vocab_size)
    max_tokens = body.max_tokens or DEFAULT_MAX_TOKENS
    for p in prompts:  # generate() checks it again; here an over-long flood is refused before any call is built
        if isinstance(p, str):
            check_length_bound(front.servicer.tokenizer, p, max_tokens, front.servicer.cap)
    prompt_logprobs = body.logprobs if body.echo else None
    reqs = [build(body, p, max_tokens, i, body.logprobs, prompt_logprobs, bias) for p in prompts
            for i in range(body.n)]
    state = Choices(front, body, prompts)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": front.model}
    if body.stream:
        with_usage = body.stream_options is not None and body.stream_options.include_usage
        gen, first = await open_stream(front.servicer, reqs, request, rid, described(prompts, body))

        def chunks(i, r):
            o = Output()
            o.add(r)
            yield {"choices": [state.choice(i, o)], **usage_fields(body, state.usage)}

        def tail():
            if with_usage:
                yield {"choices": [], "usage": state.usage()}
        return event_stream(gen, first, chunks, tail, rid, head)
    outs = await collect(front.servicer, reqs, request, rid, described(prompts, body))
    return {**head, "choices": [state.choice(i, o) for i, o in enumerate(outs)], "usage": state.usage()}


def described(prompts: list, body: CompletionRequest) -> str:
    """The request in its log line, written once it ends (Merged)."""
    return f"completion, {len(prompts)} prompt(s) x {body.n} choice(s)" + (f", user {body.user!r}" if body.user else "")
