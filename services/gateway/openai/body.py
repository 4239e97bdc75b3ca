"""Reading and checking a request body: a size bound counted on the bytes as they arrive (Content-Length and
chunked alike), a time bound on the whole body, strict JSON (no NaN/Infinity, valid UTF-8, an object), then
the pydantic model; every refusal is an ApiError naming what was wrong."""
from __future__ import annotations

import asyncio
import json

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from .errors import ApiError
from .generation import ClientGone


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise ApiError(400, "bad_content_length", f"Content-Length {length[:40]!r} is not a number")
        if int(length) > max_bytes:
            raise ApiError(413, "body_too_large", f"body of {int(length)} bytes; the limit is {max_bytes}")
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
