"""Overload at the gateway (issue 12, point 4) on a real stack: a 10 MB prompt is refused from its length with the
numbers (gRPC, HTTP completions, chat), a call past --max-concurrent-requests is refused at once with RetryInfo
(gRPC) and Retry-After (HTTP), and the admitted requests still get oracle-correct tokens."""
import json
import time
import urllib.error
import urllib.request

import grpc
import pytest

from pdserve import launcher
from pdserve.client import build_request
from pdserve.common.errors import from_rpc_error
from tests.integration.drain_util import gateway_over
from tests.integration.helpers import prompt

HUGE = "x" * 10_000_000  # the tiny tokenizer's longest token has 9 characters: at least 1,111,112 tokens


@pytest.fixture(scope="module")
def gw(stack, model_dir):
    """A gateway over the package stack's instances that runs one Generate call at a time and reads 32 MB bodies
    and messages (the default receive limit would refuse the 10 MB prompt before its length is checked)."""
    proc = gateway_over(stack, model_dir, stack.procs["prefill"], stack.procs["decode"], http=True, extra=(
        "--max-concurrent-requests", "1", "--http-max-body-bytes", str(32 << 20), "--max-request-bytes",
        str(32 << 20)))
    yield proc
    launcher.stop(proc)


def post(proc, path: str, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{proc.http_port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def grpc_error(proc, **kw):
    with pytest.raises(grpc.RpcError) as e:
        list(proc.stub.Generate(build_request(**kw), timeout=60))
    return from_rpc_error(e.value)


def test_a_10_mb_prompt_is_refused_with_its_numbers(gw):
    err = grpc_error(gw, prompt=HUGE, max_tokens=16)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.reason == "CONTEXT_EXCEEDED"
    assert err.message == ("prompt is at least 1111112 tokens (10000000 characters, no token spans more than 9) + "
                           "max_tokens 16 = 1111128; the model's context length is 4096")
    status, headers, body = post(gw, "/v1/completions", {"prompt": HUGE, "max_tokens": 16})
    assert status == 400 and body["error"]["code"] == "context_exceeded" and "retry-after" not in headers
    assert "at least 1111112 tokens" in body["error"]["message"] and "4096" in body["error"]["message"]
    # chat: the bound applies to the rendered template, with max_tokens unset (what the context leaves)
    status, _, body = post(gw, "/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE}]})
    assert status == 400 and body["error"]["code"] == "context_exceeded", body
    assert "+ max_tokens 1 " in body["error"]["message"] and "10000000" not in body["error"]["message"]
    assert "context length is 4096" in body["error"]["message"]


def _overload_metric(proc) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5).read().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("pdserve_overload_rejections_total{") and
                'service="gateway"' in ln and 'reason="concurrency"' in ln)
    return float(line.rsplit(" ", 1)[1])


def test_past_the_limit_a_call_is_refused_with_retry_info_and_admitted_ones_stay_correct(gw, oracle):
    before = _overload_metric(gw)
    held = prompt(24, 1201)
    stream = gw.stub.Generate(build_request(prompt_token_ids=held, max_tokens=2000, ignore_eos=True), timeout=120)
    tokens = list(next(stream).token_ids)  # running now: it holds the gateway's one slot for ~2000 decode steps
    err = grpc_error(gw, prompt_token_ids=prompt(8, 1202), max_tokens=4)
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.reason == "OVERLOADED", err
    assert "limit 1" in err.message and err.retry_after_s is not None and err.retry_after_s > 0
    status, headers, body = post(gw, "/v1/completions", {"prompt": prompt(8, 1203), "max_tokens": 4})
    assert status == 429 and body["error"]["code"] == "overloaded", body
    assert int(headers["retry-after"]) >= 1
    # an over-long prompt is told it can never fit, not to retry, even while the gateway is full
    assert grpc_error(gw, prompt=HUGE, max_tokens=16).reason == "CONTEXT_EXCEEDED"
    for r in stream:
        tokens.extend(r.token_ids)
        if len(tokens) >= 12:
            break
    stream.cancel()
    oracle.check(held, tokens)
    assert _overload_metric(gw) == before + 2
    # once the held call is gone, a request is admitted (retrying on its RetryInfo while the cancel lands)
    p = prompt(30, 1204)
    for _ in range(100):
        try:
            out = list(gw.stub.Generate(build_request(prompt_token_ids=p, max_tokens=6, ignore_eos=True), timeout=60))
            break
        except grpc.RpcError as e:
            assert from_rpc_error(e).reason == "OVERLOADED"
            time.sleep(min(from_rpc_error(e).retry_after_s, 0.05))
    else:
        raise AssertionError("the gateway still refused after 100 tries: the cancelled call kept its slot")
    ids = [t for r in out for t in r.token_ids]
    assert len(ids) == 6
    oracle.check(p, ids)
