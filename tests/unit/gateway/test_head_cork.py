"""The HTTP server's head cork: a response's head goes out in the same write as its first body chunk (one segment,
one wake-up of the client on the first token's path), the bytes on the wire are those the application sent, in its
order, and a head whose body is late is not held past the event-loop turn it was written in."""
import asyncio
import functools

from pdserve.gateway.openai.server import HttpServer, Limits, LimitedH11

WRITES: list[bytes] = []


class RecordingH11(LimitedH11):
    """Records every write that reaches the socket's transport."""

    def connection_made(self, transport) -> None:
        plain = transport.write

        def write(data):
            WRITES.append(bytes(data))
            plain(data)
        transport.write = write
        super().connection_made(transport)


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await receive()
    late = scope["path"] == "/late"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    if late:
        await asyncio.sleep(0.3)
    await send({"type": "http.response.body", "body": b"data: first\n\n", "more_body": True})
    await asyncio.sleep(0.01)
    await send({"type": "http.response.body", "body": b"data: second\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def serve_and_get(path: str):
    limits = Limits(max_body_bytes=1 << 20)
    server = HttpServer(app, "127.0.0.1", 0, limits, 1.0)
    server.config.http = functools.partial(RecordingH11, limits=limits)
    port = await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.2)  # before a late body is sent
        rest = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        return head + rest
    finally:
        await server.close()


def test_the_head_and_the_first_chunk_go_out_in_one_write():
    WRITES.clear()
    got = asyncio.run(serve_and_get("/"))
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and b"data: first\n\n" in got and b"data: second\n\n" in got
    assert got == b"".join(WRITES)  # the same bytes in the same order
    assert WRITES[0].startswith(b"HTTP/1.1 200 OK\r\n") and WRITES[0].endswith(b"data: first\n\n\r\n"), WRITES
    assert b"data: second" not in WRITES[0]  # only the first chunk joins the head: later ones are not held


def test_a_head_whose_body_is_late_goes_out_alone_at_once():
    WRITES.clear()
    got = asyncio.run(serve_and_get("/late"))  # the head is read within 0.2 s; the body comes 0.3 s later
    assert got == b"".join(WRITES)
    assert WRITES[0].startswith(b"HTTP/1.1 200 OK\r\n") and WRITES[0].endswith(b"\r\n\r\n"), WRITES
    assert b"data: first" in got
