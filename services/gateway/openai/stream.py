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


# json.dumps(obj, ensure_ascii=False) builds an encoder per call; this one is built once and writes the same text
_encode = json.JSONEncoder(ensure_ascii=False).encode


def _event(obj) -> bytes:
    return b"data: " + _encode(obj).encode() + b"\n\n"


class ChunkFormat:
    """The SSE events of one response: the fields every chunk shares (head: id, object, created, model) are encoded
    once; a chunk gives only its own fields (choices, usage). The bytes are those of
    json.dumps({**head, **fields}, ensure_ascii=False): same keys in the same order, same escapes."""

    def __init__(self, head: dict | None = None):
        # '{"id": "cmpl-…", …' without its closing brace; the fields' own encoding follows after ", "
        self._prefix = "data: " + _encode(head)[:-1] + ", " if head else None

    def event(self, fields: dict) -> bytes:
        if self._prefix is None or not fields:
            return _event(fields)
        return (self._prefix + _encode(fields)[1:] + "\n\n").encode()


async def _first(gen):
    try:
        return await gen.__anext__()
    except BaseException:
        await gen.aclose()
        raise


async def open_stream(servicer, reqs, request, rid: str, what: str = "generate"):
    """The merged calls and their first message; raises the refusal of a request that never started, or
    ClientGone when the client leaves while it waits (in the admission queue, during prefill). what: for the log
    line (Merged)."""
    gen = merged(servicer, reqs, rid, tenant=tenant_of(request), what=what)
    return gen, await until_disconnect(request, _first(gen), rid)


def event_stream(gen, first, chunks: Callable[[int, object], Iterable[dict]], tail: Callable[[], Iterable[dict]],
                 rid: str, head: dict | None = None) -> StreamingResponse:
    """chunks(i, message): the events of one message of choice i; tail(): the events after the last one
    (the usage chunk). head: the fields every event of chunks and tail starts with (ChunkFormat), which they leave
    out. A client that leaves cancels the stream (Starlette watches for the disconnect). Messages that arrived
    while the last write went out (gen.ready(), a Merged) go out in one write; one that arrives alone goes out
    alone, at once."""
    fmt = ChunkFormat(head)
    ready = getattr(gen, "ready", None)

    async def body():
        out: list[bytes] = []  # events not yet written: on a failure they go out before the error event

        def add(events: Iterable[dict]) -> None:
            for c in events:
                out.append(fmt.event(c))

        try:
            async with contextlib.aclosing(gen):
                add(chunks(*first))
                while True:
                    if ready is not None:
                        for i, r in ready():
                            add(chunks(i, r))
                    if out:
                        data = b"".join(out)
                        out.clear()
                        yield data
                    try:
                        i, r = await gen.__anext__()
                    except StopAsyncIteration:
                        break
                    add(chunks(i, r))
                add(tail())
        except PdError as e:
            log.warning("http request %s: stream failed: %s", rid, e)
            if out:
                yield b"".join(out)
            out = [_event(ApiError.from_pd(e).body())]
        except Exception as e:  # not CancelledError: a client that left reads nothing more
            log.error("http request %s: stream failed", rid, exc_info=e)
            if out:
                yield b"".join(out)
            out = [_event(ApiError.internal(rid).body())]
        else:  # the last events and [DONE] in one write
            out.append(b"data: [DONE]\n\n")
            yield b"".join(out)
            return
        yield out[0]
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
