"""Driving prefill and decode directly, the way the gateway does, for tests that need to see leases."""
from __future__ import annotations

import json
import os
import random
import secrets
import subprocess
import time

import grpc

from pdserve.common.errors import from_rpc_error
from pdserve.common.proto import common_pb2, decode_pb2, prefill_pb2


def prompt(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(2, 512) for _ in range(n)]


def with_template(model_dir: str, d, template: str) -> str:
    """The checkpoint in folder d with another chat template than its own (a file of its own there: writing through
    a link would change the shared checkpoint)."""
    for name in os.listdir(model_dir):
        if name != "tokenizer_config.json":
            os.symlink(os.path.join(model_dir, name), d / name)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template,
                                                         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return str(d)


def sampling(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, top_p=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)


def allocate(stack, n_prompt: int, max_tokens: int, d: int = 0):
    rid = secrets.token_bytes(16)
    dest = stack.decodes[d].Allocate(decode_pb2.AllocateRequest(
        request_id=rid, num_prompt_tokens=n_prompt, max_tokens=max_tokens), timeout=30).destination
    return rid, dest


def prefill(stack, rid, tokens, dest, max_tokens: int, p: int = 0):
    return stack.prefills[p].Prefill(prefill_pb2.PrefillRequest(
        request_id=rid, token_ids=tokens, sampling=sampling(max_tokens), destination=dest), timeout=60)


def decode_stream(stack, rid, tokens, resp, max_tokens: int, d: int = 0):
    return stack.decodes[d].Decode(decode_pb2.DecodeRequest(
        request_id=rid, num_prompt_tokens=len(tokens), first_token=resp.first_token, sampling=sampling(max_tokens),
        coverage=resp.coverage), timeout=60)


def collect(stream) -> tuple[list[int], object]:
    """All tokens of a decode stream and its error (None when it finished)."""
    toks = []
    try:
        for r in stream:
            toks.append(r.token_id)
    except grpc.RpcError as e:
        return toks, from_rpc_error(e)
    return toks, None


def wait_no_leases(stack, timeout: float = 10.0):
    """Releases are asynchronous: poll until no page is leased; returns the pool states."""
    deadline = time.monotonic() + timeout
    while True:
        states = stack.pool_states()
        if all(s.num_leased == 0 for s in states) or time.monotonic() > deadline:
            return states
        time.sleep(0.1)


def wait_for(pred, timeout: float, what: str) -> float:
    """Polls pred until it holds; returns the seconds it took, raises naming `what` after timeout."""
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - start


def drained(stack, pools: int | None = None) -> bool:
    """Every pool idle: no page leased, quarantined or read; cached pages (prefix reuse, unread: evictable) count
    as idle. pools: how many the broker must know (a restarted broker that a decode has not re-registered with
    yet knows fewer)."""
    try:
        states = stack.pool_states()
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND:  # a restarted broker that decode has not re-registered with yet
            return False
        if from_rpc_error(e).reason == "NOT_LEADER":
            # broker replicas: a killed leader's key stands until its etcd lease lapses, and meanwhile every replica
            # refuses (fail closed); the wait goes on until the next one leads
            return False
        raise
    return (pools is None or len(states) == pools) and all(
        s.num_leased == 0 and s.num_quarantined == 0 and s.num_shared_reads == 0
        and s.num_free + s.num_cached == s.num_pages for s in states)


def generate_when_served(stack, prompt_ids: list[int], max_tokens: int, timeout: float = 15.0,
                         refused_code: str | None = None) -> dict:
    """Asks the gateway until it serves again (after a partition or a restart) and returns the last answer;
    refused_code: the only error code allowed meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        out = stack.generate(prompt_token_ids=prompt_ids, max_tokens=max_tokens, ignore_eos=True)
        if "error" not in out or time.monotonic() > deadline:
            return out
        if refused_code is not None:
            assert out["error"]["code"] == refused_code, out
        time.sleep(0.2)


def reset_connections(port: int) -> int:
    """Resets every live TCP connection to 127.0.0.1:port, as a proxy's restart or a conntrack flush would (both
    ends see ECONNRESET); returns how many sockets were reset. Needs iproute2's `ss` and CAP_NET_ADMIN."""
    out = subprocess.run(["ss", "-K", "-tnH", "dst", "127.0.0.1", "dport", "=", str(port)], capture_output=True,
                         text=True, timeout=10)
    if out.returncode != 0:
        raise AssertionError(f"`ss -K` could not reset connections to port {port} (rc {out.returncode}): "
                             f"{out.stderr.strip()}")
    return sum(1 for line in out.stdout.splitlines() if line.strip())


def refusal(call) -> tuple[grpc.StatusCode, str]:
    """The (code, reason) a call that must be refused was refused with; raises if it was answered."""
    try:
        call()
    except grpc.RpcError as e:
        err = from_rpc_error(e)
        return err.code, err.reason
    raise AssertionError("answered")
