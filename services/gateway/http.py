"""OpenAI-compatible HTTP front of the gateway: POST /v1/completions (JSON or SSE), GET /v1/models, /health.

A small HTTP/1.1 server on asyncio streams (no extra dependency); each request goes through the same
admission and streaming path as gRPC Generate.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

from ..common.errors import PdError
from ..common.proto import common_pb2, gateway_pb2

log = logging.getLogger(__name__)

HTTP_STATUS = {"INVALID_ARGUMENT": 400, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
               "CANCELLED": 499, "DATA_LOSS": 500, "INTERNAL": 500, "FAILED_PRECONDITION": 400, "NOT_FOUND": 404}
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests", 499: "Client Closed Request",
           500: "Internal Server Error", 503: "Service Unavailable", 504: "Gateway Timeout"}
FINISH = {common_pb2.FINISH_REASON_LENGTH: "length", common_pb2.FINISH_REASON_STOP: "stop"}


def _to_request(body: dict) -> gateway_pb2.GenerateRequest:
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # OpenAI allows a batch of one
    req = gateway_pb2.GenerateRequest(max_tokens=int(body.get("max_tokens", 16)),
                                      temperature=float(body.get("temperature", 1.0)),
                                      ignore_eos=bool(body.get("ignore_eos", False)))
    if isinstance(prompt, list):
        req.prompt_token_ids.extend(int(t) for t in prompt)
    else:
        req.prompt = str(prompt)
    if "top_p" in body:
        req.top_p = float(body["top_p"])
    if body.get("seed") is not None:
        req.seed = int(body["seed"])
    return req


class HttpFront:
    def __init__(self, servicer, model: str):
        self.servicer = servicer
        self.model = model

    async def _send(self, writer, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        writer.write(f"HTTP/1.1 {status} {REASONS.get(status, '')}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()

    async def _error(self, writer, err: PdError) -> None:
        await self._send(writer, HTTP_STATUS.get(err.code.name, 500),
                         {"error": {"code": err.code.name, "reason": err.reason, "message": err.message}})

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            if method == "GET" and path == "/health":
                await self._send(writer, 200, {"status": "ok"})
            elif method == "GET" and path == "/v1/models":
                await self._send(writer, 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
            elif method == "POST" and path == "/v1/completions":
                try:
                    req = _to_request(json.loads(body or b"{}"))
                except (ValueError, TypeError) as e:
                    await self._send(writer, 400, {"error": {"code": "INVALID_ARGUMENT", "reason": "BAD_JSON",
                                                             "message": str(e)}})
                    return
                stream = bool(json.loads(body or b"{}").get("stream", False))
                await (self._stream(writer, req) if stream else self._complete(writer, req))
            else:
                await self._send(writer, 404, {"error": {"code": "NOT_FOUND", "reason": "NO_ROUTE",
                                                         "message": f"{method} {path}"}})
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client left: the Generate task is cancelled below with the connection
        except Exception:
            log.exception("HTTP request failed")
        finally:
            writer.close()

    async def _complete(self, writer, req) -> None:
        ids, text, finish, prompt_tokens, rid = [], [], None, 0, b""
        try:
            async for r in self.servicer.generate(req):
                ids.extend(r.token_ids)
                text.append(r.text)
                prompt_tokens = r.prompt_tokens or prompt_tokens
                rid = r.request_id or rid
                finish = FINISH.get(r.finish_reason, finish)
        except PdError as e:
            await self._error(writer, e)
            return
        await self._send(writer, 200, {
            "id": f"cmpl-{rid.hex()}", "object": "text_completion", "created": int(time.time()), "model": self.model,
            "choices": [{"index": 0, "text": "".join(text), "token_ids": ids, "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids),
                      "total_tokens": prompt_tokens + len(ids)}})

    async def _stream(self, writer, req) -> None:
        started = False
        try:
            async for r in self.servicer.generate(req):
                if not started:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                                 b"Connection: close\r\n\r\n")
                    started = True
                chunk = {"object": "text_completion", "model": self.model, "choices": [{
                    "index": 0, "text": r.text, "token_ids": list(r.token_ids),
                    "finish_reason": FINISH.get(r.finish_reason)}]}
                writer.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                await writer.drain()
        except PdError as e:
            if not started:
                await self._error(writer, e)
                return
            err = {"error": {"code": e.code.name, "reason": e.reason, "message": e.message}}
            writer.write(b"data: " + json.dumps(err).encode() + b"\n\n")
        writer.write(b"data: [DONE]\n\n")
        await writer.drain()


async def start_http(servicer, model: str, host: str, port: int) -> asyncio.base_events.Server:
    front = HttpFront(servicer, model)
    return await asyncio.start_server(front.handle, host, port)
