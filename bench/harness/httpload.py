"""A closed loop of streaming OpenAI `/v1/completions` clients over plain HTTP/1.1, the one client the vLLM
comparison points at both systems (bench/versus/).

Standard library only (asyncio streams, chunked decoding by hand), so neither system's client library is in the
measurement and the client costs both the same: one keep-alive connection per client, the body built once per
request, each server-sent event parsed as it arrives. A token's time is the arrival of the event that carried it.
"""
from __future__ import annotations

import asyncio
import json
import time

from .workload import Record


class HttpError(RuntimeError):
    """A response that was not a 200 event stream, or a stream that broke off."""


class _Conn:
    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 24)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
            self.writer = None

    async def post_stream(self, path: str, body: bytes, headers: dict | None = None):
        """Yields the payload of every `data:` event of one streamed POST; the connection stays open after it."""
        if self.writer is None:
            await self.open()
        more = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                          f"Content-Type: application/json\r\nAccept: text/event-stream\r\n{more}"
                          f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await self.writer.drain()
        r = self.reader
        status = (await r.readline()).decode("latin-1").split(" ", 2)
        if not status[0]:
            raise HttpError("the server closed the connection before a status line")
        headers = {}
        while (line := await r.readline()) not in (b"\r\n", b"\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        if len(status) < 2 or status[1] != "200":
            raw = await (self._dechunk_all() if chunked else r.readexactly(int(headers.get("content-length", 0))))
            raise HttpError(f"HTTP {' '.join(status[1:]).strip()}: {raw[:500].decode(errors='replace')}")
        if not chunked:  # uvicorn streams chunked; a length-delimited body is read whole and split
            raw = await r.readexactly(int(headers.get("content-length", 0)))
            for event in raw.split(b"\n\n"):
                if event.startswith(b"data: "):
                    yield event[6:]
            return
        buf = b""
        while True:
            size = int((await r.readline()).split(b";")[0], 16)
            if size == 0:
                await r.readline()  # the empty trailer
                break
            buf += await r.readexactly(size)
            await r.readexactly(2)
            while (cut := buf.find(b"\n\n")) >= 0:
                event, buf = buf[:cut], buf[cut + 2:]
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        yield line[6:]
        if buf.strip():
            raise HttpError(f"stream ended inside an event: {buf[:200]!r}")
        if headers.get("connection", "").lower() == "close":
            await self.close()

    async def _dechunk_all(self) -> bytes:
        out = b""
        while (size := int((await self.reader.readline()).split(b";")[0], 16)) > 0:
            out += await self.reader.readexactly(size)
            await self.reader.readexactly(2)
        await self.reader.readline()
        return out


def completion_body(model: str, prompt: list[int], max_tokens: int, extra: dict | None = None) -> bytes:
    """Greedy, ignore_eos, streamed: every system produces exactly max_tokens tokens for the same prompt."""
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, **(extra or {})}).encode()


async def read_completion(conn: _Conn, rec: Record, body: bytes, headers: dict | None = None) -> None:
    """One streamed completion into rec: each event's token ids, at the time the event arrived."""
    async for data in conn.post_stream("/v1/completions", body, headers):
        if data == b"[DONE]":
            continue  # the stream is read to its last chunk, or the connection's next response starts mid-body
        now = time.perf_counter()
        msg = json.loads(data)
        if "error" in msg:
            raise HttpError(f"error event: {str(msg['error'])[:300]}")
        for choice in msg.get("choices", ()):
            ids = choice.get("token_ids") or []
            rec.token_ids.extend(ids)
            rec.token_times.extend([now] * len(ids))


async def _load(host: str, port: int, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
                extra: dict | None, timeout: float) -> tuple[list[Record], float]:
    records: list[Record | None] = [None] * len(prompts)
    next_index = iter(range(len(prompts)))
    conns = [_Conn(host, port) for _ in range(min(concurrency, len(prompts)))]
    for c in conns:  # connected before the clock starts, as the gRPC client waits for channel_ready
        await c.open()

    async def client(conn: _Conn) -> None:
        for i in next_index:
            body = completion_body(model, prompts[i], max_tokens, extra)
            rec = Record(time.perf_counter())
            records[i] = rec
            try:
                await asyncio.wait_for(read_completion(conn, rec, body), timeout)
            except (HttpError, OSError, ValueError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
                rec.error = f"{type(e).__name__}: {e}"[:300]
                await conn.close()  # the stream's state is unknown: the next request opens a fresh connection
            if rec.error is None and len(rec.token_ids) != max_tokens:
                rec.error = f"{len(rec.token_ids)} token ids streamed, {max_tokens} asked for"

    start = time.perf_counter()
    try:
        await asyncio.gather(*(client(c) for c in conns))
    finally:
        for c in conns:
            await c.close()
    return records, time.perf_counter() - start


def run_http_load(base_url: str, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
                  extra: dict | None = None, timeout: float = 600.0) -> tuple[list[Record], float]:
    """Closed loop of `concurrency` streaming clients over `prompts` against base_url (http://host:port);
    `extra` joins every request body (vLLM returns token ids only when asked: return_token_ids).
    Records are in prompt order; the wall time runs from the first send to the last stream's end."""
    hostport = base_url.removeprefix("http://").rstrip("/")
    host, _, port = hostport.rpartition(":")
    return asyncio.run(_load(host, int(port), model, prompts, concurrency, max_tokens, extra, timeout))
