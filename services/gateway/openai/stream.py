"""Server-sent events: the first message is awaited before the 200 goes out, so a request refused at
admission gets its own status; a later failure of any kind becomes an error event (the gateway's own: the request
id, its exception in the log). Every stream a client still reads ends with [DONE]."""
from __future__ import annotations

import contextlib
import json
import logging
from typing import Callable, Iterable

from fastapi.responses import StreamingResponse

from ...common.errors import PdError
from .errors import ApiError
from .generation import merged, tenant_of, until_disconnect

log = logging.getLogger(__name__)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage_fields(body, current: Callable[[], dict]) -> dict:
    """What a chunk carries under stream_options: nothing, usage null (include_usage: the last chunk has it), or
    the usage so far (continuous_usage_stats)."""
    opts = body.stream_options
    if opts is None or not opts.include_usage:
        return {}
    return {"usage": current() if opts.continuous_usage_stats else None}


def _event(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _first(gen):
    try:
        return await gen.__anext__()
    except BaseException:
        await gen.aclose()
        raise


async def open_stream(servicer, reqs, request, rid: str):
    """The merged calls and their first message; raises the refusal of a request that never started, or
    ClientGone when the client leaves while it waits (in the admission queue, during prefill)."""
    gen = merged(servicer, reqs, rid, tenant=tenant_of(request))
    return gen, await until_disconnect(request, _first(gen), rid)


def event_stream(gen, first, chunks: Callable[[int, object], Iterable[dict]], tail: Callable[[], Iterable[dict]],
                 rid: str) -> StreamingResponse:
    """chunks(i, message): the events of one message of choice i; tail(): the events after the last one
    (the usage chunk). A client that leaves cancels the stream (Starlette watches for the disconnect)."""
    async def body():
        try:
            async with contextlib.aclosing(gen):
                for c in chunks(*first):
                    yield _event(c)
                async for i, r in gen:
                    for c in chunks(i, r):
                        yield _event(c)
                for c in tail():
                    yield _event(c)
        except PdError as e:
            log.warning("http request %s: stream failed: %s", rid, e)
            yield _event(ApiError.from_pd(e).body())
        except Exception as e:  # not CancelledError: a client that left reads nothing more
            log.error("http request %s: stream failed", rid, exc_info=e)
            yield _event(ApiError.internal(rid).body())
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
