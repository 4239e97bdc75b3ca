"""The vLLM comparison's own parts that can be wrong without a vLLM: the HTTP client against a stub server that
streams as uvicorn does (chunked server-sent events on a keep-alive connection), the `vllm` name shim, and the
target's verdicts."""
import importlib.metadata
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdserve.bench.harness.httpload import run_http_load
from pdserve.bench.report_vllm import pair_runs, verdict
from pdserve.bench.side_by_side import compare_ids
from pdserve.bench.peers.vllm_venv import write_name_shim


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


def _run(system, p, c, tok_s, ttft, errors=0):
    return {"system": system, "preset": "tiny", "prompt_len": p, "concurrency": c, "out_tok_s": tok_s,
            "ttft_p50": ttft, "num_errors": errors, "num_requests": 4}


def test_verdicts_follow_the_target():
    runs = [_run("pdserve", 1024, 4, 99.0, 0.05), _run("vLLM-CPU", 1024, 4, 100.0, 0.06),
            _run("pdserve", 128, 1, 10.0, 9.0), _run("vLLM-CPU", 128, 1, 100.0, 0.01),
            _run("pdserve", 4096, 16, 200.0, 0.5), _run("vLLM-CPU", 4096, 16, 100.0, 0.4),
            # one request of four served, fast: its figures beat vLLM's, but the cell is a miss
            _run("pdserve", 32768, 4, 2.0, 0.1, errors=3), _run("vLLM-CPU", 32768, 4, 1.0, 0.2),
            _run("pdserve", 128, 4, 2.0, 0.1), _run("vLLM-CPU", 128, 4, 1.0, 0.2, errors=1)]
    pairs = pair_runs(runs)
    assert verdict(1024, 4, *pairs[("tiny", 1024, 4)]) == "tok/s MISSED, TTFT met"
    assert verdict(128, 1, *pairs[("tiny", 128, 1)]) == "(no target)"  # neither concurrency >= 4 nor prompt >= 1,024
    assert verdict(4096, 16, *pairs[("tiny", 4096, 16)]) == "tok/s met, TTFT MISSED"
    assert verdict(32768, 4, *pairs[("tiny", 32768, 4)]) == "MISSED (pdserve 3 of 4 failed)"
    assert verdict(128, 4, *pairs[("tiny", 128, 4)]) == "not compared (vLLM 1 of 4 failed)"


def test_token_ids_are_compared_only_where_both_streamed():
    ids = {("pdserve", "tiny", 128, 4): [[5, 6, 7], [5, 6, 7], []],   # the third failed before its first token
           ("vLLM-CPU", "tiny", 128, 4): [[5, 6, 7], [5, 9, 7], [1, 2, 3]],
           ("pdserve", "tiny", 128, 16): [[1]]}                      # vLLM did not run this cell
    assert compare_ids(ids) == [{"row": "tiny", "prompt_len": 128, "concurrency": 4, "requests": 2, "failed": 1,
                                 "identical": 1, "tokens_equal": 5, "tokens": 6, "first_divergence_min": 1}]
