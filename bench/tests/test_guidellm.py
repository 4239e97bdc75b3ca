"""The guidellm step's scenario and its reading of guidellm's output, on files guidellm 0.8.1 wrote against a
pdserve stack: concurrency 1 and 2 (16-token prompts, 4 output tokens, 2 and 3 requests), and a run whose
4,100-token prompts the gateway refused (over the 4,096 context). Expected figures are recomputed from the
per-request timings in the same file, not from guidellm's own aggregates."""
import asyncio
import gzip
import json
import math
import os

import pytest

from pdserve.bench.peers.guidellm import GuidellmError, parse, scenario

DATA = os.path.join(os.path.dirname(__file__), "data")


def unpack(tmp_path, name: str, edit=None) -> tuple[str, dict]:
    with gzip.open(os.path.join(DATA, name), "rt") as f:
        doc = json.load(f)
    if edit:
        edit(doc)
    path = tmp_path / name.removesuffix(".gz")
    path.write_text(json.dumps(doc))
    return str(path), doc


def nearest_rank(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[max(math.ceil(q * len(s)) - 1, 0)]


def test_parse_successful_runs(tmp_path):
    path, doc = unpack(tmp_path, "guidellm-0.8.1-concurrent-1-2.json.gz")
    got = parse(path)
    assert [g["concurrency"] for g in got] == [1, 2]
    for g, b in zip(got, doc["benchmarks"]):
        reqs = b["requests"]["successful"]
        t = [r["info"]["timings"] for r in reqs]
        out = [r["output_metrics"]["text_tokens"] for r in reqs]
        ttft = [x["first_token_iteration"] - x["request_start"] for x in t]
        itl = [(x["last_token_iteration"] - x["first_token_iteration"]) / (n - 1) for x, n in zip(t, out)]
        assert (g["num_requests"], g["successful"], g["errored"], g["incomplete"]) == (len(reqs), len(reqs), 0, 0)
        assert g["first_error"] is None
        for key, xs in (("ttft", ttft), ("itl", itl)):
            assert g[f"{key}_p50"] == pytest.approx(nearest_rank(xs, 0.5), rel=1e-9)
            assert g[f"{key}_p99"] == pytest.approx(nearest_rank(xs, 0.99), rel=1e-9)
        assert g["out_tok_s"] == pytest.approx(sum(out) / b["duration"], rel=1e-6)
        assert g["req_s"] == pytest.approx(len(reqs) / b["duration"], rel=1e-6)
        assert (g["prompt_tokens_p50"], g["output_tokens_p50"]) == (16, 4)
    assert [g["num_requests"] for g in got] == [2, 3]


def test_parse_refused_requests(tmp_path):
    path, _ = unpack(tmp_path, "guidellm-0.8.1-over-long.json.gz")
    [g] = parse(path)
    assert (g["concurrency"], g["num_requests"], g["successful"], g["errored"]) == (2, 3, 0, 3)
    assert "400 Bad Request" in g["first_error"] and "/v1/completions" in g["first_error"]
    assert math.isnan(g["ttft_p50"]) and g["out_tok_s"] == 0.0


def test_parse_refuses_unknown_output(tmp_path):
    path, _ = unpack(tmp_path, "guidellm-0.8.1-over-long.json.gz", lambda d: d["metadata"].update(version=3))
    with pytest.raises(GuidellmError, match="format 3 .*guidellm 0.8.1.*reads format 2"):
        parse(path)
    path, _ = unpack(tmp_path, "guidellm-0.8.1-over-long.json.gz", lambda d: d.update(benchmarks=[]))
    with pytest.raises(GuidellmError, match=r"no benchmarks .*\(0 of 1\)"):
        parse(path)
    path, _ = unpack(tmp_path, "guidellm-0.8.1-over-long.json.gz",
                     lambda d: d["benchmarks"][0]["metrics"].pop("inter_token_latency_ms"))
    with pytest.raises(GuidellmError, match="lacks 'inter_token_latency_ms'"):
        parse(path)


def _guidellm_schema():
    """guidellm's models; its import installs uvloop's event loop policy process-wide, which is put back."""
    policy = asyncio.get_event_loop_policy()
    try:
        return pytest.importorskip("guidellm.schemas.benchmark")
    finally:
        asyncio.set_event_loop_policy(policy)


def test_scenario_is_valid_for_guidellm(tmp_path):
    schema = _guidellm_schema()
    spec = scenario("http://127.0.0.1:1", "/models/x", 128, 32, [1, 4], [8, 16], str(tmp_path / "o.json"))
    s = schema.BenchmarkScenario.model_validate(spec).spec  # unknown fields are refused by guidellm's models
    assert (s.backend.request_format, s.profile.streams, s.constraints[0].count) == ("/v1/completions", [1, 4], [8, 16])
    assert (s.data[0].prompt_tokens, s.data[0].output_tokens, s.tokenizer.model) == (128, 32, "/models/x")
    with pytest.raises(ValueError, match="2 concurrencies but 1 request counts"):
        scenario("http://x", "/m", 1, 1, [1, 2], [3], "o.json")
