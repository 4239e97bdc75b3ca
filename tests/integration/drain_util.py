"""Helpers of the drain tests: a gateway over chosen instances, and streams read by one thread each."""
from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request

import grpc

from pdserve import launcher
from pdserve.client import build_request
from pdserve.common.errors import from_rpc_error
from pdserve.common.pki import files_for
from pdserve.common.proto import gateway_pb2_grpc


def gateway_over(stack, model_dir: str, prefills: list, decodes: list, http: bool = False,
                 extra: tuple[str, ...] = ()) -> launcher.Proc:
    """A gateway process that knows only these instances (so its requests can run nowhere else)."""
    f = files_for(stack.tls_dir, "gateway/gateway0")
    args = ["gateway", "--port", "0", "--metrics-port", "0", "--http-port", "0" if http else "-1",
            "--model", model_dir, "--tls-cert", f.cert, "--tls-key", f.key, "--tls-ca", f.ca, *extra]
    for p in prefills:
        args += ["--prefill", p.target]
    for d in decodes:
        args += ["--decode", d.target]
    proc = launcher.start("gateway-drain", args, {"PDSERVE_ENABLE_FAULTS": "1"})
    proc.stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(proc.target))
    return proc


@contextlib.contextmanager
def openai_gateway(stack, model_dir: str, key: str):
    """An HTTP gateway over the stack's prefill and decode serving model_dir's tokenizer and template, with its
    official client as .client (no retries: every refusal is seen)."""
    import openai

    proc = gateway_over(stack, model_dir, stack.procs["prefill"], stack.procs["decode"], http=True,
                        extra=("--api-key", key))
    try:
        proc.client = openai.OpenAI(base_url=f"http://127.0.0.1:{proc.http_port}/v1", api_key=key, max_retries=0)
        yield proc
    finally:
        launcher.stop(proc)


class Streams:
    """One Generate stream per prompt, each read by its own thread; records tokens and errors."""

    def __init__(self, target: str, prompts: list[list[int]], max_tokens: int):
        self.prompts = prompts
        self.channel = grpc.insecure_channel(target)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.started = [threading.Event() for _ in prompts]
        self.outs: list[dict | None] = [None] * len(prompts)
        self.t0 = time.monotonic()
        self.first_at: list[float | None] = [None] * len(prompts)  # seconds from t0: first token, end of stream
        self.end_at: list[float | None] = [None] * len(prompts)
        self.threads = [threading.Thread(target=self._run, args=(i, max_tokens), daemon=True)
                        for i in range(len(prompts))]
        for t in self.threads:
            t.start()

    def _run(self, i: int, max_tokens: int) -> None:
        toks: list[int] = []
        req = build_request(prompt_token_ids=self.prompts[i], max_tokens=max_tokens, ignore_eos=True)
        try:
            for r in self.stub.Generate(req, timeout=300):
                toks.extend(r.token_ids)
                if self.first_at[i] is None:
                    self.first_at[i] = time.monotonic() - self.t0
                self.started[i].set()
        except grpc.RpcError as e:
            err = from_rpc_error(e)
            self.outs[i] = {"error": {"code": err.code.name, "reason": err.reason, "message": err.message},
                            "token_ids": toks}
        else:
            self.outs[i] = {"token_ids": toks}
        finally:
            self.end_at[i] = time.monotonic() - self.t0
            self.started[i].set()

    def wait_started(self, timeout: float) -> None:
        """Until every stream has its first token (a stream that failed first counts, and fails the test later)."""
        for e in self.started:
            assert e.wait(timeout), "a stream got no token"
        ended = [i for i, o in enumerate(self.outs) if o is not None]
        assert not ended, "a stream ended before the drain began: " + "; ".join(
            f"stream {i}: first token at {self.first_at[i]}s, ended at {self.end_at[i]:.2f}s after "
            f"{len(self.outs[i]['token_ids'])} tokens, {self.outs[i].get('error', 'complete')}" for i in ended) + (
            f"; first tokens of all at {self.first_at}")

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "a stream is still running"
        self.channel.close()

    def results(self) -> list[tuple[list[int], dict]]:
        return list(zip(self.prompts, self.outs))


def post_completion(port: int, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
