"""A decode whose drain timeout ends while streams still run hands them back rather than cutting them: each ends
UNAVAILABLE DRAINED with the tokens it streamed, and the gateway resubmits prompt + those tokens to another decode,
so the client's stream goes on there (a KEDA scale-down, a rollout). With no other decode the client gets that
typed, retryable error, over gRPC and over HTTP/SSE (an error event, then [DONE]). One stack of 1 prefill and 2
decodes with a short drain timeout; each test points a gateway of its own at the decodes it needs."""
import http.client
import json
import os
import re
import signal
import threading
import time
import urllib.request

import pytest

from pdserve import launcher
from pdserve.common.proto import broker_pb2
from tests.integration.drain_util import Streams, gateway_over
from tests.integration.helpers import prompt, wait_for
from tests.integration.stack import Stack

DRAIN_S = 0.5
LONG_TOKENS = 2000  # far longer than the drain timeout on any machine: the stream is still running when it ends
EXIT_BOUND_S = DRAIN_S + 5.0 + 1.0 + 5.0 + 30.0  # drain, hand-back bound, server grace, give-backs, loaded machine


@pytest.fixture(scope="module")
def hand_back_stack(model_dir):
    s = Stack(model_dir, num_prefill=1, num_decode=2, extra={"decode": ["--drain-timeout", str(DRAIN_S)]})
    yield s
    s.close()


def _resubmissions(gw, outcome: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{gw.metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith(f'pdserve_resubmissions_total{{outcome="{outcome}"}} '))


def _holding(s: Stack) -> list[int]:
    """The decodes whose pool has leased pages: where a stream runs."""
    return [i for i, st in enumerate(s.pool_states()) if st.num_leased]


def _sigterm(s: Stack, i: int) -> tuple[int, float, object]:
    """SIGTERM decode i; its exit status, how long it took, and its pool read right after the exit (a lease left
    behind would still be held: the broker revokes only after its TTL)."""
    proc, pool = s.procs["decode"][i], s.pool_ids()[i]
    t0 = time.monotonic()
    os.killpg(proc.popen.pid, signal.SIGTERM)
    rc = proc.popen.wait(EXIT_BOUND_S)
    took = time.monotonic() - t0
    return rc, took, s.broker.GetPoolState(broker_pb2.GetPoolStateRequest(pool_id=pool), timeout=5)


class Sse:
    """One streamed /v1/completions call read by a thread of its own: its data events, in order."""

    def __init__(self, port: int, body: dict):
        self.events: list[str] = []
        self.started = threading.Event()
        self.status = None
        self._thread = threading.Thread(target=self._run, args=(port, body), daemon=True)
        self._thread.start()

    def _run(self, port: int, body: dict) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            self.status = r.status
            while line := r.readline():
                if line.startswith(b"data: "):
                    self.events.append(line[len(b"data: "):].decode().strip())
                    self.started.set()
        finally:
            conn.close()
            self.started.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the SSE stream is still open"


def test_a_drained_decode_hands_its_stream_to_the_other_one_and_the_client_gets_every_token(
        hand_back_stack, model_dir, oracle):
    """A 2,000-token stream runs on one of two decodes; that one gets SIGTERM with a 1 s drain timeout: it hands
    the stream back after the tokens it streamed, the gateway resubmits prompt + those tokens to the other decode,
    and the client receives all 2,000 tokens, which pass the oracle. The resubmission is counted; the drained
    decode exits 0 with no page leased."""
    s = hand_back_stack
    gw = gateway_over(s, model_dir, s.procs["prefill"], s.procs["decode"])
    try:
        p = prompt(40, 2701)
        stream = Streams(gw.target, [p], max_tokens=LONG_TOKENS)
        stream.wait_started(60)
        wait_for(lambda: len(_holding(s)) == 1, 10, "one decode holding the stream's pages")
        victim = _holding(s)[0]
        before = _resubmissions(gw, "resubmitted"), _resubmissions(gw, "gave_up")
        rc, took, state = _sigterm(s, victim)
        stream.join(120)
        after = _resubmissions(gw, "resubmitted"), _resubmissions(gw, "gave_up")
        gw_lines = "".join(gw.lines)
    finally:
        launcher.stop(gw)
    (_, out), = stream.results()
    d = s.procs["decode"][victim]
    print(f"decode{victim} drained in {took:.2f}s; stream ended at {stream.end_at[0]:.2f}s")
    print("".join(ln for ln in d.lines if "drain" in ln or "stop" in ln))
    assert "error" not in out, out
    assert len(out["token_ids"]) == LONG_TOKENS, len(out["token_ids"])
    oracle.check_many([(p, out["token_ids"])])
    # handed back mid-way: some tokens came from the drained decode, the rest from the other one
    m = re.search(r"request handed back \(DRAINED\) after (\d+) of 2000 tokens", gw_lines)
    assert m and 0 < int(m.group(1)) < LONG_TOKENS, gw_lines[-3000:]
    assert after == (before[0] + 1, before[1]), (before, after)
    assert any("handing back 1 running" in ln for ln in d.lines), "".join(d.lines[-30:])
    assert rc == 0, "".join(d.lines[-30:])
    assert state.num_leased == 0, state


def test_with_no_other_decode_the_stream_ends_with_a_typed_retryable_error(hand_back_stack, model_dir, oracle):
    """The only decode a gateway knows drains with a gRPC stream and an SSE stream running: each ends UNAVAILABLE
    DRAINED saying that no other decode takes work, after tokens that pass the oracle; the SSE stream with an
    error event, then [DONE]. Both count as given up, not resubmitted."""
    s = hand_back_stack
    alive = [i for i, d in enumerate(s.procs["decode"]) if d.alive()]
    last = alive[-1]
    gw = gateway_over(s, model_dir, s.procs["prefill"], [s.procs["decode"][last]], http=True)
    try:
        p_grpc, p_http = prompt(30, 2801), prompt(35, 2802)
        stream = Streams(gw.target, [p_grpc], max_tokens=LONG_TOKENS)
        sse = Sse(gw.http_port, {"prompt": p_http, "max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True,
                                 "stream": True})
        stream.wait_started(60)
        assert sse.started.wait(60) and sse.status == 200, (sse.status, sse.events)
        before = _resubmissions(gw, "resubmitted"), _resubmissions(gw, "gave_up")
        rc, took, state = _sigterm(s, last)
        stream.join(60)
        sse.join(60)
        after = _resubmissions(gw, "resubmitted"), _resubmissions(gw, "gave_up")
    finally:
        launcher.stop(gw)
    (_, out), = stream.results()
    print(f"decode{last} drained in {took:.2f}s; gRPC stream: {len(out['token_ids'])} tokens, "
          f"SSE: {len(sse.events)} events")
    err = out.get("error")
    assert err and (err["code"], err["reason"]) == ("UNAVAILABLE", "DRAINED"), out.get("error", out)
    assert "no other decode instance takes work" in err["message"], err
    assert 0 < len(out["token_ids"]) < LONG_TOKENS
    assert sse.events[-1] == "[DONE]", sse.events[-3:]
    body = json.loads(sse.events[-2])
    assert body["error"]["code"] == "drained", body
    assert "UNAVAILABLE DRAINED" in body["error"]["message"], body
    assert "no other decode instance takes work" in body["error"]["message"], body
    ids = [t for e in sse.events[:-2] for t in json.loads(e)["choices"][0]["token_ids"]]
    assert 0 < len(ids) < LONG_TOKENS
    oracle.check_many([(p_grpc, out["token_ids"]), (p_http, ids)])
    assert after == (before[0], before[1] + 2), (before, after)
    assert rc == 0, "".join(s.procs["decode"][last].lines[-30:])
    assert state.num_leased == 0, state
