"""POST /v1/chat/completions: the conversation is rendered by the checkpoint's chat template (as
transformers' apply_chat_template renders it) and the text encoded with the gateway's tokenizer, adding no
special tokens (the template writes its own). JSON or SSE; logprobs in the chat format."""
from __future__ import annotations

import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from ...engine.chat import ChatTemplateError
from ..admit import encode_prompt
from .body import parse, read_body
from .errors import ApiError
from .generation import Output, build, collect
from .schema import ChatRequest
from .stream import event_stream, open_stream, usage, usage_fields

log = logging.getLogger(__name__)


def _entry(tok, t: int, logprob: float) -> dict:
    s = tok.decode([t])
    return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def logprobs_of(tok, o: Output) -> dict:
    return {"content": [{**_entry(tok, t, lp.logprob), "top_logprobs": [
        _entry(tok, i, v) for i, v in zip(lp.top_token_ids, lp.top_logprobs)]} for t, lp in zip(o.token_ids,
                                                                                              o.logprobs)]}


def _max_tokens(body: ChatRequest, num_prompt: int, context_length: int) -> int:
    """max_completion_tokens (OpenAI's current name) or max_tokens; unset: what the context leaves."""
    a, b = body.max_completion_tokens, body.max_tokens
    if a is not None and b is not None and a != b:
        raise ApiError(400, "invalid_value", f"max_completion_tokens {a} and max_tokens {b} disagree; send one",
                       param="max_completion_tokens")
    return a or b or max(1, context_length - num_prompt)


def prompt_ids(front, body: ChatRequest) -> list[int]:
    if front.template is None:
        raise ApiError(400, "no_chat_template", f"the model `{front.model}` has no chat template "
                                                f"(tokenizer_config.json chat_template); use /v1/completions")
    try:
        text = front.template.render([m.to_template() for m in body.messages], body.add_generation_prompt,
                                     tools=body.tools, **(body.chat_template_kwargs or {}))
    except ChatTemplateError as e:
        raise ApiError(400, "chat_template_error", str(e), param="messages") from None
    # unset, max_tokens defaults to what the context leaves (at least 1): a prompt that cannot fit with 1 fits with none
    least = body.max_completion_tokens or body.max_tokens or 1
    return encode_prompt(front.servicer.tokenizer, text, least, front.servicer.cap)


async def handle(front, request: Request) -> Response:
    rid = request.state.request_id
    body = parse(await read_body(request, front.limits.max_body_bytes, front.limits.body_timeout_s), ChatRequest)
    front.check(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "invalid_value", "top_logprobs needs logprobs: true", param="top_logprobs")
    ids = prompt_ids(front, body)
    if not ids:
        raise ApiError(400, "empty_prompt", "the chat template rendered an empty prompt", param="messages")
    log.info("http request %s: chat, %d messages, %d prompt tokens x %d choice(s)%s", rid, len(body.messages),
             len(ids), body.n, f", user {body.user!r}" if body.user else "")
    max_tokens = _max_tokens(body, len(ids), front.servicer.cap.context_length)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    reqs = [build(body, ids, max_tokens, i, logprobs, None) for i in range(body.n)]
    tok = front.servicer.tokenizer
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": front.model}
    if body.stream:
        with_usage = body.stream_options is not None and body.stream_options.include_usage
        started = [False] * body.n
        counts = [0] * body.n

        def chunks(i, r):
            o = Output()
            o.add(r)
            counts[i] += len(o.token_ids)
            delta = {"content": "".join(o.text)}
            if not started[i]:
                started[i] = True
                delta = {"role": "assistant", **delta}
            choice = {"index": i, "delta": delta, "logprobs": logprobs_of(tok, o) if body.logprobs else None,
                      "finish_reason": o.finish}
            yield {**head, "object": "chat.completion.chunk", "choices": [choice],
                   **usage_fields(body, lambda: usage(len(ids), sum(counts)))}

        def tail():
            if with_usage:
                yield {**head, "object": "chat.completion.chunk", "choices": [],
                       "usage": usage(len(ids), sum(counts))}
        return event_stream(*await open_stream(front.servicer, reqs, request, rid), chunks, tail, rid)
    outs = await collect(front.servicer, reqs, request, rid)
    choices = [{"index": i, "message": {"role": "assistant", "content": "".join(o.text)},
                "logprobs": logprobs_of(tok, o) if body.logprobs else None, "finish_reason": o.finish}
               for i, o in enumerate(outs)]
    return {**head, "object": "chat.completion", "choices": choices,
            "usage": usage(len(ids), sum(len(o.token_ids) for o in outs))}
