"""Load against a running pdserve stack through the gateway's public gRPC API, and /metrics scraping."""
from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import grpc

from pdserve.client import build_request
from pdserve.common.errors import from_rpc_error
from pdserve.common.proto import gateway_pb2_grpc

from .openloop import GAVE_UP
from .workload import Record

_LINE = re.compile(r"^(\w+)(?:\{(.*)\})? (\S+)$")


def scrape(port: int) -> dict[tuple[str, str], float]:
    """One /metrics page as {(name, 'k="v",...'): value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


def delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


async def _load(target: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
                timeout: float) -> tuple[list[Record], float]:
    records: list[Record | None] = [None] * len(prompts)
    next_index = iter(range(len(prompts)))
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        await ch.channel_ready()  # the connection is set up before the clock starts, not inside a TTFT

        async def client() -> None:
            for i in next_index:
                req = build_request(prompt_token_ids=prompts[i], max_tokens=max_tokens, ignore_eos=True)
                rec = Record(time.perf_counter())
                records[i] = rec
                try:
                    async for r in stub.Generate(req, timeout=timeout):
                        now = time.perf_counter()
                        for tok in r.token_ids:
                            rec.token_ids.append(tok)
                            rec.token_times.append(now)
                except grpc.RpcError as e:
                    err = from_rpc_error(e)
                    rec.error = f"{err.code.name} {err.reason}"

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(min(concurrency, len(prompts)))))
        return records, time.perf_counter() - start


def run_load(target: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
             timeout: float = 300.0) -> tuple[list[Record], float]:
    """Closed loop of `concurrency` streaming clients over `prompts`; Records are in prompt order."""
    return asyncio.run(_load(target, prompts, concurrency, max_tokens, timeout))


async def _open(target: str, prompts: list[list[int]], offsets: list[float], max_tokens: int,
                deadline_s: float) -> tuple[list[Record], float, list[float]]:
    records = [Record(0.0) for _ in prompts]
    lags: list[float] = []
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        await ch.channel_ready()
        start = time.perf_counter()

        async def client(i: int) -> None:
            rec = records[i]
            rec.arrival = start + offsets[i]
            await asyncio.sleep(max(0.0, rec.arrival - time.perf_counter()))
            lags.append(time.perf_counter() - rec.arrival)
            call = stub.Generate(build_request(prompt_token_ids=prompts[i], max_tokens=max_tokens, ignore_eos=True),
                                 timeout=300.0)
            stream = call.__aiter__()

            def take(r) -> None:
                now = time.perf_counter()
                rec.token_ids.extend(r.token_ids)
                rec.token_times.extend([now] * len(r.token_ids))

            try:
                # the client waits for its first token until the deadline, then cancels the call (the gateway sees
                # CANCELLED, as when a user leaves); once streaming it stays to the end
                while not rec.token_ids:
                    left = rec.arrival + deadline_s - time.perf_counter()
                    take(await asyncio.wait_for(stream.__anext__(), max(0.0, left)))
                async for r in stream:
                    take(r)
            except asyncio.TimeoutError:
                call.cancel()
                rec.error = GAVE_UP
            except StopAsyncIteration:
                rec.error = "stream ended before its first token"
            except grpc.RpcError as e:
                err = from_rpc_error(e)
                rec.error = f"{err.code.name} {err.reason}"

        await asyncio.gather(*(client(i) for i in range(len(prompts))))
        return records, time.perf_counter() - start, lags


def run_open(target: str, prompts: list[list[int]], offsets: list[float], max_tokens: int,
             deadline_s: float) -> tuple[list[Record], float, list[float]]:
    """Open loop: prompt i is sent `offsets[i]` s after the start whatever else is outstanding; a request with no
    first token `deadline_s` after its scheduled send is cancelled (Record.error GAVE_UP). Returns the Records in
    prompt order, the wall time (start to the last request's end) and each send's lag behind its schedule."""
    if len(offsets) != len(prompts):
        raise ValueError(f"run_open: {len(offsets)} offsets for {len(prompts)} prompts")
    return asyncio.run(_open(target, prompts, offsets, max_tokens, deadline_s))
