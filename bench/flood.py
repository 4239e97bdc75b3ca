"""A flood of over-long prompts against the gateway, in its own process so it does not share the
benchmark client's event loop: `python -m pdserve.bench.flood TARGET --prompt-len N [--rate R] --seconds S`.

Prints {"ready": true} once connected, then one JSON line: how many were sent, how many were
rejected with INVALID_ARGUMENT (as they must be), anything else, and the round-trip latency.
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

from .workload import percentile


async def flood(target: str, prompt_len: int, rate: float, seconds: float, concurrency: int,
                stop_on_stdin: bool = False) -> dict:
    req = build_request(prompt_token_ids=[7] * prompt_len, max_tokens=32, ignore_eos=True)
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
                async for _ in stub.Generate(req, timeout=30):
                    pass
            except grpc.RpcError as e:
                code = e.code().name
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
    sent = sum(codes.values())
    return {"sent": sent, "codes": codes, "wall_s": wall, "rejected": codes.get("INVALID_ARGUMENT", 0),
            "rejected_per_s": codes.get("INVALID_ARGUMENT", 0) / wall, "lat_p50": percentile(lat, 50),
            "lat_p99": percentile(lat, 99), "client_cpu_s": cpu}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.flood")
    p.add_argument("target")
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--rate", type=float, default=0.0, help="requests/s; 0 = closed loop, as fast as possible")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--stop-on-stdin", action="store_true", help="also stop when a line (or EOF) arrives on stdin")
    a = p.parse_args()
    print(json.dumps(asyncio.run(flood(a.target, a.prompt_len, a.rate, a.seconds, a.concurrency, a.stop_on_stdin))),
          flush=True)


if __name__ == "__main__":
    main()
