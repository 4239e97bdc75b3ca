"""The side-by-side run's client against a stub server that streams as uvicorn does (chunked server-sent events on
a keep-alive connection): the harness's closed loop, the protocol's closed loop (which stops by the protocol's
rule) and its open loop (which sends on schedule), and the `vllm` name shim."""
import importlib.metadata
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdserve.bench.harness.httpload import run_http_load
from pdserve.bench.peers.vllm_venv import write_name_shim
from pdserve.bench.versus import protocol
from pdserve.bench.versus.load import closed_loop, open_loop


class _Sse(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a client reuses its connection, as the bench's do
    bodies: list = []
    connections: set = set()

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        type(self).connections.add(self.client_address)
        if body["model"] != "m":
            err = json.dumps({"error": {"message": f"no model {body['model']}"}}).encode()
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(err)))
            self.end_headers()
            self.wfile.write(err)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        first = body["prompt"][0]
        # tokens first, first+1, ... ; two tokens in one event, and one event cut across two chunks
        events = [{"choices": [{"token_ids": [first]}]}, {"choices": [{"token_ids": [first + 1, first + 2]}]},
                  {"choices": [{"token_ids": [first + 3]}]}]
        raw = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        cut = raw.index(b"data: ", 10) + 7
        for part in (raw[:cut], raw[cut:]):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture
def server():
    _Sse.bodies, _Sse.connections = [], set()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Sse)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_each_client_streams_every_request_over_one_connection(server):
    prompts = [[10 * i, 1, 2] for i in range(1, 7)]
    records, wall = run_http_load(server, "m", prompts, 2, 4, extra={"return_token_ids": True})
    assert [r.error for r in records] == [None] * 6
    assert [r.token_ids for r in records] == [[10 * i + k for k in range(4)] for i in range(1, 7)]
    assert all(len(r.token_times) == 4 and r.token_times[1] == r.token_times[2] for r in records)  # one event
    assert len(_Sse.connections) == 2  # keep-alive: the second request on a connection read a clean response
    # two clients race for the first request: each body is matched to its prompt, not to its arrival order
    assert sorted(_Sse.bodies, key=lambda b: b["prompt"]) == [
        {"model": "m", "prompt": p, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True, "stream": True,
         "return_token_ids": True} for p in prompts]
    assert wall > 0


def test_a_refusal_and_a_short_stream_are_errors_with_their_reason(server):
    records, _ = run_http_load(server, "other", [[5, 6]], 1, 4)
    assert records[0].error.startswith("HttpError: HTTP 404") and "no model other" in records[0].error
    assert records[0].token_ids == []
    records, _ = run_http_load(server, "m", [[5, 6]], 1, 8)
    assert records[0].error == "4 token ids streamed, 8 asked for"


def test_name_shim_is_found_as_vllm_and_owns_only_its_files(tmp_path):
    d = write_name_shim(str(tmp_path), "0.32.0+cpu")
    dist = next(importlib.metadata.distributions(name="vllm", path=[str(tmp_path)]))
    assert dist.version == "0.32.0+cpu"  # the "+cpu" is what vLLM's platform detection looks for
    assert sorted(str(f) for f in dist.files) == sorted(f"{os.path.basename(d)}/{n}"
                                                        for n in ("METADATA", "INSTALLER", "RECORD"))


def test_the_protocols_closed_loop_stops_at_64_requests_each_with_its_own_prompt(server):
    prompts = [[10 * i, 1] for i in range(1, 80)]
    records = closed_loop(server, "m", prompts, 4, 4, {"return_token_ids": True})
    assert len(records) == protocol.MIN_REQUESTS
    assert [r.error for r in records] == [None] * 64
    assert [r.token_ids for r in records] == [[10 * i + k for k in range(4)] for i in range(1, 65)]
    assert records == sorted(records, key=lambda r: r.arrival)  # record i is prompt i, in send order
    assert len(_Sse.connections) == 4


def test_the_open_loop_sends_on_schedule_and_counts_from_the_scheduled_time(server):
    prompts = [[10 * i, 1] for i in range(1, 6)]
    offsets = [0.05, 0.1, 0.1, 0.3, 0.31]
    t0 = time.perf_counter()
    records = open_loop(server, "m", prompts, offsets, 2, 4, None)
    assert [r.token_ids for r in records] == [[10 * i + k for k in range(4)] for i in range(1, 6)]
    gaps = [b.arrival - a.arrival for a, b in zip(records, records[1:])]
    assert gaps == pytest.approx([0.05, 0.0, 0.2, 0.01], abs=1e-9)  # the schedule, not when the sends happened
    assert all(r.token_times[0] >= r.arrival for r in records) and records[0].arrival >= t0
    with pytest.raises(ValueError, match="4 send times for 5 prompts"):
        open_loop(server, "m", prompts, offsets[:4], 2, 4, None)


class _ClosesIdle(_Sse):
    timeout = 0.2  # the server closes a keep-alive connection idle this long, as uvicorn does after 5 s


def test_the_open_loop_reopens_a_pooled_connection_the_server_may_have_closed(monkeypatch):
    _Sse.bodies, _Sse.connections = [], set()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _ClosesIdle)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr("pdserve.bench.versus.load.STALE_AFTER_S", 0.1)
        # every pooled connection sits idle past the server's 0.2 s before its send: written into as the server
        # closes it, a request would be lost before its status line
        records = open_loop(f"http://127.0.0.1:{srv.server_address[1]}", "m", [[10, 1], [20, 1], [30, 1]],
                            [0.5, 0.5, 1.0], 1, 4, None)
    finally:
        srv.shutdown()
        srv.server_close()
    assert [r.error for r in records] == [None] * 3
    assert [r.token_ids for r in records] == [[10 + k for k in range(4)], [20 + k for k in range(4)],
                                              [30 + k for k in range(4)]]
