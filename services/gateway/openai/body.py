"""Reading and checking a request body: a size bound counted on the bytes as they arrive (Content-Length and
chunked alike), a time bound on the whole body, a bound on how deep its JSON nests (checked on the bytes, before
any parser recurses), strict JSON (no NaN/Infinity, valid UTF-8, an object), then the pydantic model; every refusal
is an ApiError naming what was wrong."""
from __future__ import annotations

import asyncio
import json

import numpy as np
from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from .errors import ApiError
from .generation import ClientGone


# arrays and objects nested in one body: room for real JSON schemas (response_format, tools' parameters) under the
# body's own few levels; the JSON parser, pydantic and the template all recurse once per level
MAX_JSON_DEPTH = 128
_STEP = np.zeros(256, np.int8)
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def json_depth(raw: bytes) -> int:
    """How deep JSON text nests arrays and objects, brackets inside strings not counted, without parsing it: array
    passes over the bytes (no recursion, no Python step per byte or per string)."""
    b = np.frombuffer(raw, np.uint8)
    if not b.size:
        return 0
    index = np.int32 if b.size < 2**31 else np.int64
    quote = b == ord('"')
    backslash = b == ord("\\")
    if backslash.any():  # a quote after an odd run of backslashes is escaped: it neither opens nor ends a string
        i = np.arange(b.size, dtype=index)
        last_other = np.where(backslash, index(-1), i)
        np.maximum.accumulate(last_other, out=last_other)
        run = np.zeros_like(i)  # backslashes just before each byte
        np.subtract(i[:-1], last_other[:-1], out=run[1:])
        quote &= (run & 1) == 0
    # after an odd number of quotes a byte is inside a string (an unterminated one to the end: a parser stops there)
    inside = (np.cumsum(quote, dtype=index) & 1).astype(bool)
    steps = _STEP[b].astype(index)
    steps[inside] = 0
    return max(0, int(np.cumsum(steps, out=steps).max()))


def check_depth(raw: bytes, what: str, param: str | None = None) -> None:
    """400 for JSON text nested deeper than MAX_JSON_DEPTH, before anything parses it."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:  # too few brackets to nest deeper: the usual body
        return
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise ApiError(400, "json_too_deep", f"{what} nests arrays and objects {depth} levels deep; the limit is "
                                             f"{MAX_JSON_DEPTH}", param=param)


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    length = request.headers.get("content-length")
    if length is not None:
        if not (length.isascii() and length.isdigit()):
            raise ApiError(400, "bad_content_length", f"Content-Length {length[:40]!r} is not a number")
        if len(length) > len(str(max_bytes)) or int(length) > max_bytes:  # int() only of a bounded length
            size = length if len(length) <= 40 else f"a {len(length)}-digit number of"
            raise ApiError(413, "body_too_large", f"body of {size} bytes (Content-Length); the limit is {max_bytes}")
    chunks: list[bytes] = []

    async def read() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise ApiError(413, "body_too_large", f"body over {max_bytes} bytes (limit)")
            chunks.append(chunk)

    try:  # one bound on the whole body (a wait_for per chunk made a task per chunk)
        await asyncio.wait_for(read(), timeout_s)
    except ClientDisconnect:
        raise ClientGone(f"the client left after {sum(map(len, chunks))} bytes of its body") from None
    except asyncio.TimeoutError:
        raise ApiError(408, "body_timeout", f"body not received within {timeout_s:g}s "
                                            f"({sum(map(len, chunks))} bytes by then)") from None
    return b"".join(chunks)


def parse(raw: bytes, model: type[BaseModel]) -> BaseModel:
    check_depth(raw, "the body")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise ApiError(400, "invalid_utf8", f"body is not valid UTF-8 (byte {e.start})") from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, an integer too long to parse
        raise ApiError(400, "invalid_json", f"body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_json", f"body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None


def _validation_error(e: ValidationError) -> ApiError:
    errors = e.errors(include_url=False)
    extra = [".".join(map(str, x["loc"])) for x in errors if x["type"] == "extra_forbidden"]
    if extra:
        return ApiError(400, "unsupported_field", f"unsupported field(s): {', '.join(extra)}", param=extra[0])
    # in a union: the branch that got furthest into the value, and one whose type matched
    first = max(errors, key=lambda x: (len(x["loc"]), not x["type"].endswith("_type")))
    # pydantic names the union branch it tried ('list[constrained-int]'): the client's path has no such step
    loc = [str(p) for p in first["loc"] if not (isinstance(p, str) and ("[" in p or "constrained" in p))]
    param = ".".join(loc)
    got = repr(first.get("input"))[:80]
    more = f" ({len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return ApiError(400, "invalid_value", f"{param}: {first['msg']}, got {got}{more}", param=param)
