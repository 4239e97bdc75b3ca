"""POST /v1/chat/completions: the conversation is rendered by the checkpoint's chat template (as
transformers' apply_chat_template renders it) and the text encoded with the gateway's tokenizer, adding no
special tokens (the template writes its own). JSON or SSE; logprobs in the chat format; tool calls parsed from the
output or forced through the grammar (tools.py), streamed in OpenAI's delta format (tool_stream.py)."""
from __future__ import annotations

import json
import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from ...engine.chat import ChatTemplateError
from ..admit import encode_prompt
from .body import check_depth, parse, read_body
from .errors import ApiError
from .generation import Output, build, collect, grammar_of, logit_bias_of
from .schema import ChatRequest, NamedToolChoice
from .tool_stream import ToolStream
from .tools import ToolPlan, format_of, new_call_id, plan
from .stream import event_stream, open_stream, usage, usage_fields



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


def template_args(body: ChatRequest) -> tuple[bool, dict]:
    """(add_generation_prompt, the other template variables). As in vLLM, chat_template_kwargs win over the
    request's own add_generation_prompt; the conversation and the tools come only from their own fields."""
    kwargs = dict(body.chat_template_kwargs or {})
    add = kwargs.pop("add_generation_prompt", body.add_generation_prompt)
    if not isinstance(add, bool):
        raise ApiError(400, "invalid_type", f"chat_template_kwargs.add_generation_prompt must be a boolean, got "
                                            f"{type(add).__name__}", param="chat_template_kwargs")
    if taken := sorted({"messages", "tools"} & kwargs.keys()):
        raise ApiError(400, "invalid_value", f"chat_template_kwargs may not set {', '.join(taken)}: send "
                                             f"{'them' if len(taken) > 1 else 'it'} as the request's own field",
                       param="chat_template_kwargs")
    return add, kwargs


def check_arguments(body: ChatRequest) -> None:
    """The template is given earlier tool calls' arguments parsed (schema.Message.to_template): JSON inside a JSON
    string, which the body's depth check cannot see."""
    for i, m in enumerate(body.messages):
        for j, call in enumerate(m.tool_calls or ()):
            param = f"messages.{i}.tool_calls.{j}.function.arguments"
            check_depth(call.function.arguments.encode(), param, param)


def prompt_ids(front, body: ChatRequest, render_tools: list[dict] | None) -> list[int]:
    check_arguments(body)
    if front.template is None:
        raise ApiError(400, "no_chat_template", f"the model `{front.model}` has no chat template "
                                                f"(tokenizer_config.json chat_template); use /v1/completions")
    add, kwargs = template_args(body)
    try:
        text = front.template.render([m.to_template() for m in body.messages], add, tools=render_tools, **kwargs)
    except ChatTemplateError as e:
        raise ApiError(400, "chat_template_error", str(e), param="messages") from None
    # unset, max_tokens defaults to what the context leaves (at least 1): a prompt that cannot fit with 1 fits with none
    least = body.max_completion_tokens or body.max_tokens or 1
    return encode_prompt(front.servicer.tokenizer, text, least, front.servicer.cap)


def plan_of(front, body: ChatRequest, structured: bool) -> ToolPlan:
    choice = body.tool_choice
    return plan([t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
                choice.model_dump() if isinstance(choice, NamedToolChoice) else choice, body.parallel_tool_calls,
                format_of(front.template), structured)


def finish_of(finish: str | None, has_calls: bool) -> str | None:
    """OpenAI's reason for an output that ended in tool calls (one cut by max_tokens stays "length")."""
    return "tool_calls" if has_calls and finish == "stop" else finish


async def handle(front, request: Request) -> Response:
    rid = request.state.request_id
    body = parse(await read_body(request, front.limits.max_body_bytes, front.limits.body_timeout_s), ChatRequest)
    front.check(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "invalid_value", "top_logprobs needs logprobs: true", param="top_logprobs")
    bias = logit_bias_of(body, front.servicer.cap.vocab_size)
    grammar = grammar_of(body)
    tools = plan_of(front, body, grammar != ("", False))
    if tools.schema is not None:  # required or named: the call is forced through the grammar
        grammar = (json.dumps(tools.schema, ensure_ascii=False), False)
    ids = prompt_ids(front, body, tools.render)
    if not ids:
        raise ApiError(400, "empty_prompt", "the chat template rendered an empty prompt", param="messages")
    what = (f"chat, {len(body.messages)} messages, {len(ids)} prompt tokens x {body.n} choice(s)"
            + (f", user {body.user!r}" if body.user else ""))  # logged once the request ends (Merged)
    max_tokens = _max_tokens(body, len(ids), front.servicer.cap.context_length)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    reqs = [build(body, ids, max_tokens, i, logprobs, None, bias, grammar) for i in range(body.n)]
    tok = front.servicer.tokenizer
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": front.model}
    if body.stream:
        with_usage = body.stream_options is not None and body.stream_options.include_usage
        started = [False] * body.n
        counts = [0] * body.n

        streams = [ToolStream(tools) for _ in range(body.n)] if tools.parses else None

        def chunks(i, r):
            o = Output()
            o.add(r)
            counts[i] += len(o.token_ids)
            piece, finish = "".join(o.text), o.finish
            if streams is None:
                deltas = [{"content": piece}]
            else:  # content while no call can start in it; each call once its text is whole
                deltas = streams[i].push(piece) + (streams[i].finish() if finish is not None else [])
                if not deltas and (finish is not None or body.logprobs):
                    deltas = [{}]
                finish = finish_of(finish, streams[i].has_calls)
            for k, delta in enumerate(deltas):
                if not started[i]:
                    started[i] = True
                    delta = {"role": "assistant", **delta}
                choice = {"index": i, "delta": delta,
                          "logprobs": logprobs_of(tok, o) if body.logprobs and k == 0 else None,
                          "finish_reason": finish if k == len(deltas) - 1 else None}
                yield {"choices": [choice], **usage_fields(body, lambda: usage(len(ids), sum(counts)))}

        def tail():
            if with_usage:
                yield {"choices": [], "usage": usage(len(ids), sum(counts))}
        return event_stream(*await open_stream(front.servicer, reqs, request, rid, what), chunks, tail, rid,
                            {**head, "object": "chat.completion.chunk"})
    outs = await collect(front.servicer, reqs, request, rid, what)
    choices = []
    for i, o in enumerate(outs):
        content, calls = tools.parse("".join(o.text))
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.to_openai(new_call_id()) for c in calls]
        choices.append({"index": i, "message": message, "logprobs": logprobs_of(tok, o) if body.logprobs else None,
                        "finish_reason": finish_of(o.finish, bool(calls))})
    return {**head, "object": "chat.completion", "choices": choices,
            "usage": usage(len(ids), sum(len(o.token_ids) for o in outs))}
