"""A flood of over-long prompts against the gateway, in its own process so it does not share the
benchmark client's event loop: `python -m pdserve.bench.scenarios.flood TARGET --prompt-len N [--rate R] --seconds S`.

The prompt is N token ids over gRPC, or with --text-chars C a text of C characters (refused from its length alone,
engine/token_bound.py), over gRPC or, with --http PORT, as POST /v1/completions over keep-alive HTTP/1.1 connections
written and read by hand (a client far cheaper per request than the gateway, so the gateway is what is measured).

Prints {"ready": true} once connected, then one JSON line: how many were sent, how many were
rejected with INVALID_ARGUMENT / HTTP 400 (as they must be), anything else, and the round-trip latency.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import grpc

from pdserve.client import build_request
from pdserve.common.proto import gateway_pb2_grpc

from ..harness.workload import percentile


class Http:
    """One keep-alive connection per outstanding request slot; each call writes the same request bytes and reads
    one response (status line, headers, Content-Length body)."""

    def __init__(self, port: int, text: str):
        body = json.dumps({"prompt": text, "max_tokens": 32}).encode()
        self.port = port
        self.request = (b"POST /v1/completions HTTP/1.1\r\nHost: flood\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n" % len(body)) + body
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def call(self) -> str:
        conn = self.idle.pop() if self.idle else await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = conn
        writer.write(self.request)
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b" ", 2)[1].decode()
        length = next(int(line.split(b":", 1)[1]) for line in head.lower().split(b"\r\n")
                      if line.startswith(b"content-length:"))
        await reader.readexactly(length)
        if b"connection: close" in head.lower():
            writer.close()
        else:
            self.idle.append(conn)
        return status

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()


async def flood(target: str, prompt_len: int, rate: float, seconds: float, concurrency: int,
                stop_on_stdin: bool = False, text_chars: int = 0, http_port: int = 0) -> dict:
    text = "x" * text_chars
    req = build_request(prompt=text, prompt_token_ids=None if text else [7] * prompt_len, max_tokens=32,
                        ignore_eos=True)
    http = Http(http_port, text) if http_port else None
    codes: dict[str, int] = {}
    lat: list[float] = []
    async with grpc.aio.insecure_channel(target) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        await ch.channel_ready()
        print(json.dumps({"ready": True}), flush=True)

        async def one() -> None:
            t = time.perf_counter()
            code = "OK"
            try:
                if http is not None:
                    code = await http.call()
                else:
                    async for _ in stub.Generate(req, timeout=30):
                        pass
            except grpc.RpcError as e:
                code = e.code().name
            except (OSError, asyncio.IncompleteReadError) as e:
                code = type(e).__name__
            lat.append(time.perf_counter() - t)
            codes[code] = codes.get(code, 0) + 1

        stop = asyncio.Event()
        if stop_on_stdin:  # the benchmark writes a line (or closes the pipe) when its measurement ends
            loop = asyncio.get_running_loop()

            def _stop() -> None:
                loop.remove_reader(sys.stdin.fileno())
                stop.set()
            loop.add_reader(sys.stdin.fileno(), _stop)
        cpu0 = time.process_time()
        start = time.perf_counter()
        end = start + seconds
        if rate <= 0:  # as fast as `concurrency` closed-loop clients go
            async def worker():
                while time.perf_counter() < end and not stop.is_set():
                    await one()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:  # open loop at `rate`, at most `concurrency` outstanding (a slow gateway cannot pile up tasks)
            sem = asyncio.Semaphore(concurrency)
            tasks = []
            k = 0

            async def paced():
                try:
                    await one()
                finally:
                    sem.release()

            while True:
                due = start + k / rate
                if due >= end or stop.is_set():
                    break
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                await sem.acquire()
                tasks.append(asyncio.ensure_future(paced()))
                k += 1
            await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu0
    if http is not None:
        http.close()
    sent = sum(codes.values())
    rejected = codes.get("400" if http else "INVALID_ARGUMENT", 0)
    return {"sent": sent, "codes": codes, "wall_s": wall, "rejected": rejected, "rejected_per_s": rejected / wall,
            "lat_p50": percentile(lat, 50), "lat_p99": percentile(lat, 99), "client_cpu_s": cpu,
            "transport": "http" if http else "grpc", "prompt": f"{text_chars} characters" if text else
            f"{prompt_len} token ids"}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.scenarios.flood")
    p.add_argument("target")
    p.add_argument("--prompt-len", type=int, default=0, help="send this many token ids (or --text-chars)")
    p.add_argument("--rate", type=float, default=0.0, help="requests/s; 0 = closed loop, as fast as possible")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--stop-on-stdin", action="store_true", help="also stop when a line (or EOF) arrives on stdin")
    p.add_argument("--text-chars", type=int, default=0, help="send a text prompt of this many characters instead")
    p.add_argument("--http", type=int, default=0, metavar="PORT",
                   help="send POST /v1/completions to this HTTP port (needs --text-chars)")
    a = p.parse_args()
    if a.http and not a.text_chars:
        p.error("--http needs --text-chars")
    if (a.prompt_len > 0) == (a.text_chars > 0):
        p.error("give one of --prompt-len and --text-chars")
    print(json.dumps(asyncio.run(flood(a.target, a.prompt_len, a.rate, a.seconds, a.concurrency, a.stop_on_stdin,
                                       a.text_chars, a.http))), flush=True)


if __name__ == "__main__":
    main()
