"""guidellm, a benchmark client nobody here wrote, run against the stack's OpenAI `/v1/completions`: its scenario
(synthetic prompts of a fixed token count, through the checkpoint's own tokenizer) and the figures read back from
its JSON output. Its numbers are the HTTP client's view; pdserve's own client measures the same load over gRPC."""
from __future__ import annotations

import json
import os
import subprocess
import sys

FORMAT_VERSION = 2  # metadata.version of guidellm's JSON output that parse() reads


class GuidellmError(RuntimeError):
    """guidellm failed, or wrote output this parser does not know."""


def scenario(target: str, model_dir: str, prompt_len: int, output_tokens: int, streams: list[int],
             counts: list[int], out_path: str, seed: int = 0) -> dict:
    """One benchmark per concurrency in `streams` (closed loop), `counts[i]` requests each."""
    if len(streams) != len(counts):
        raise ValueError(f"{len(streams)} concurrencies but {len(counts)} request counts")
    return {"spec": {
        "backend": {"kind": "openai_http", "target": target, "request_format": "/v1/completions"},
        "profile": {"kind": "concurrent", "streams": streams},
        "data": [{"kind": "synthetic_text", "prompt_tokens": prompt_len, "output_tokens": output_tokens}],
        "tokenizer": {"kind": "huggingface_auto", "model": model_dir},
        "constraints": [{"kind": "max_requests", "count": counts}],
        "seed": {"kind": "static", "value": seed},
        "outputs": [{"kind": "json", "path": out_path}],
    }}


def run(spec: dict, scenario_path: str, timeout_s: float) -> list[dict]:
    """Runs guidellm on `spec` and returns parse() of what it wrote; the console output goes nowhere."""
    with open(scenario_path, "w") as f:
        json.dump(spec, f, indent=1)
    out_path = spec["spec"]["outputs"][0]["path"]
    if os.path.exists(out_path):
        os.remove(out_path)  # a result of an earlier run must not pass for this one's
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # the tokenizer is a local folder
    proc = subprocess.run([sys.executable, "-m", "guidellm", "run", "--config", scenario_path,
                           "--disable-console-interactive"], capture_output=True, text=True, timeout=timeout_s,
                          env=env, stdin=subprocess.DEVNULL)
    if proc.returncode != 0 or not os.path.exists(out_path):
        raise GuidellmError(f"guidellm exited {proc.returncode} without {out_path}: "
                            f"{(proc.stderr or proc.stdout)[-2000:]}")
    return parse(out_path)


def _p(stats: dict, name: str, scale: float) -> float:
    return stats["percentiles"][name] * scale if stats["count"] else float("nan")


def _benchmark(b: dict) -> dict:
    m = b["metrics"]
    ok = {k: v["successful"] for k, v in m.items() if isinstance(v, dict) and "successful" in v}
    totals = m["request_totals"]
    errors = [r["info"].get("error") for r in b["requests"]["errored"]]
    return {
        "concurrency": b["config"]["strategy"]["streams"],
        "num_requests": totals["total"], "successful": totals["successful"], "errored": totals["errored"],
        "incomplete": totals["incomplete"], "first_error": next((e for e in errors if e), None),
        "duration_s": b["duration"],
        # seconds, as pdserve's own Summary
        "ttft_p50": _p(ok["time_to_first_token_ms"], "p50", 1e-3),
        "ttft_p99": _p(ok["time_to_first_token_ms"], "p99", 1e-3),
        "itl_p50": _p(ok["inter_token_latency_ms"], "p50", 1e-3),
        "itl_p99": _p(ok["inter_token_latency_ms"], "p99", 1e-3),
        "out_tok_s": ok["output_tokens_per_second"]["mean"] if ok["output_tokens_per_second"]["count"] else 0.0,
        "req_s": ok["requests_per_second"]["mean"] if ok["requests_per_second"]["count"] else 0.0,
        # the load as guidellm counted it, to show it is the load pdserve's own client sends
        "prompt_tokens_p50": _p(ok["prompt_token_count"], "p50", 1),
        "output_tokens_p50": _p(ok["output_token_count"], "p50", 1),
    }


def parse(path: str) -> list[dict]:
    """Per benchmark (one per concurrency): request counts, TTFT and ITL percentiles (s), output tokens/s and
    requests/s over the successful requests, and the token counts guidellm measured."""
    with open(path) as f:
        doc = json.load(f)
    meta = doc.get("metadata", {}) if isinstance(doc, dict) else {}
    if meta.get("version") != FORMAT_VERSION:
        raise GuidellmError(f"{path}: guidellm output format {meta.get('version')!r} "
                            f"(guidellm {meta.get('guidellm_version')}), this parser reads format {FORMAT_VERSION}")
    if not doc.get("benchmarks"):
        raise GuidellmError(f"{path}: no benchmarks in guidellm's output (0 of {len(doc['config']['benchmarks'])})")
    try:
        return [_benchmark(b) for b in doc["benchmarks"]]
    except (KeyError, TypeError) as e:
        raise GuidellmError(f"{path}: guidellm output lacks {e} (guidellm {meta.get('guidellm_version')})") from e
