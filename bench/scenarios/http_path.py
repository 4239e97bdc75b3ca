"""The gateway's HTTP side alone: the OpenAI front (Envelope, metrics, FastAPI, body checks, SSE) under uvicorn, in
front of a servicer whose first message is ready at once, so a client's time to first token is the HTTP side's own
cost. The server runs in a child process (its CPU time read from /proc); the client is bench/harness/httpload.py's
closed loop, the one the vLLM comparison uses.

    python -m pdserve.bench.scenarios.http_path [--requests 400] [--max-tokens 32] [--prompt 128] [--profile out.prof]

Prints TTFT p50/min and the server's CPU time per request."""
from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
from types import SimpleNamespace

from pdserve.common.proto import common_pb2, gateway_pb2


class InstantServicer:
    """generate(): max_tokens messages, the first carrying the internal request id (as the real one does)."""

    def __init__(self, vocab_size: int = 32000):
        from pdserve.engine.tokenizer import ByteTokenizer
        self.tokenizer = ByteTokenizer(vocab_size)
        self.cap = SimpleNamespace(context_length=4096, vocab_size=vocab_size, page_size=16, decode_pool_pages=4096,
                                   prefill_pool_tokens=65536, model="m")
        self.draining = False
        self.prefills = self.decodes = SimpleNamespace(backends=[1])

    async def generate(self, request, deadline=None, tenant=None):
        n = request.max_tokens
        for k in range(n):
            r = gateway_pb2.GenerateResponse(token_ids=[65 + k % 26], text=chr(65 + k % 26))
            if k == 0:
                r.request_id = os.urandom(16)
                r.prompt_tokens = len(request.prompt_token_ids)
            if k == n - 1:
                r.finish_reason = common_pb2.FINISH_REASON_LENGTH
            yield r


def _serve(port_q, profile: str | None, log_path: str) -> None:
    from pdserve.gateway.openai.app import Front, create_app
    from pdserve.gateway.openai.server import HttpServer, Limits
    logging.basicConfig(level=logging.INFO, filename=log_path,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def main():
        front = Front(InstantServicer(), ["m"], Limits(max_body_bytes=1 << 20))
        server = HttpServer(create_app(front, None), "127.0.0.1", 0, Limits(max_body_bytes=1 << 20), 1.0)
        port_q.put(await server.start())
        await asyncio.Event().wait()

    if profile:
        import cProfile
        import signal
        prof = cProfile.Profile()

        def stop(*_):
            prof.disable()
            prof.dump_stats(profile)
            os._exit(0)
        signal.signal(signal.SIGTERM, stop)
        prof.enable()
    asyncio.run(main())


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--profile", default=None)
    p.add_argument("--log", default="/dev/null")
    args = p.parse_args(argv)
    from ..harness.httpload import run_http_load
    q = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=_serve, args=(q, args.profile, args.log))
    proc.start()
    try:
        port = q.get(timeout=60)
        url = f"http://127.0.0.1:{port}"
        prompts = [[(7 * i + j) % 30000 + 1 for j in range(args.prompt)] for i in range(args.requests)]
        run_http_load(url, "m", prompts[:20], 1, args.max_tokens)  # warm
        cpu0 = _cpu(proc.pid)
        recs, wall = run_http_load(url, "m", prompts, 1, args.max_tokens)
        cpu = _cpu(proc.pid) - cpu0
    finally:
        proc.terminate()
        proc.join(10)
    errors = [r.error for r in recs if r.error]
    ttft = sorted((r.token_times[0] - r.arrival) * 1e3 for r in recs if not r.error)
    e2e = sorted((r.token_times[-1] - r.arrival) * 1e3 for r in recs if not r.error)
    print(f"ttft_p50_ms={statistics.median(ttft):.3f} ttft_min_ms={ttft[0]:.3f} e2e_p50_ms={statistics.median(e2e):.3f} "
          f"server_cpu_ms_per_req={cpu / len(recs) * 1e3:.3f} errors={len(errors)} {errors[:1]}")


if __name__ == "__main__":
    main()
