"""A byte-level TCP proxy for tests that need a real network partition between two services (works the same
with or without TLS on the link). partition(): bytes of open connections are dropped on the floor (the peers
see a silent, dead link, as in a real partition) and new connections are closed at once; heal(): the dead
connections are closed and new ones go through again."""
from __future__ import annotations

import asyncio
import threading


class TcpProxy:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1"):
        self.upstream = (host, upstream_port)
        self.partitioned = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = self._run(asyncio.start_server(self._handle, host, 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self.target = f"{host}:{self.port}"

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _handle(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        if self.partitioned:
            down_w.close()
            return
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            down_w.close()
            return
        pair = {down_w, up_w}
        self._writers |= pair
        try:
            await asyncio.gather(self._pipe(down_r, up_w), self._pipe(up_r, down_w))
        finally:
            for w in pair:
                self._writers.discard(w)
                w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                if self.partitioned:
                    continue  # a partition loses bytes silently: nobody is told
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()  # one direction ended: end the other, as a dropped connection would

    def partition(self) -> None:
        async def go():
            self.partitioned = True
        self._run(go())

    def heal(self) -> None:
        async def go():
            for w in list(self._writers):
                w.close()
            self._writers.clear()
            self.partitioned = False
        self._run(go())

    def retarget(self, upstream_port: int) -> None:
        """Points new connections at another upstream and closes the open ones (a Service whose endpoint moved)."""
        async def go():
            self.upstream = (self.upstream[0], upstream_port)
            for w in list(self._writers):
                w.close()
            self._writers.clear()
        self._run(go())

    def close(self) -> None:
        async def go():
            self._server.close()
            for w in list(self._writers):
                w.close()
        self._run(go())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
