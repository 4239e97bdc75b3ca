"""One long prompt through the whole stack, checked by the long-context oracle (issue 19): `python -m
pdserve.bench.scenarios.long_prompt [--prompt 32768]`, from the repository root (the oracle lives in tests/oracle.py).

The long preset (max_position_embeddings 1,048,576, bf16) served with --dtype float32, pools as large as the
context, prefill in passes of --pass-tokens: prints TTFT (chunked prefill + transfer + decode's checks), ITL, the
prefill passes and KV bytes the stack counted, and the teacher-forcing result of every generated token against
transformers' SDPA reference (tests/oracle.py LongOracle) with that reference's peak RSS, measured in a fresh
process of its own, beside what eager attention's scores alone would take. tests/integration/test_long_prompt.py
is the 16,384-token case in `make test`."""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

from pdserve import launcher

from ..harness.pdclient import delta, scrape
from ..harness.common import RESULTS, ensure_model, log
from ..harness.stack import cpu_seconds, machine_cpu_seconds

MiB = 2**20
# the checkout this file is in, links resolved: tests/ (the oracle) sits beside bench/
CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


def _high_water() -> int:
    """This process's peak RSS in bytes (VmHWM: ru_maxrss would count what the parent held before the fork)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _oracle_child(model_dir: str, path: str) -> None:
    """In a fresh process, so that its peak RSS is the reference's alone; prints one JSON line."""
    import torch

    sys.path.insert(0, CHECKOUT)
    from tests.oracle import LongOracle, OracleMismatch, check_response_rows, check_served_logprobs

    with open(path) as f:
        job = json.load(f)
    oracle = LongOracle(model_dir)
    loaded = _high_water()
    began = time.perf_counter()
    out = {"threads": torch.get_num_threads()}
    try:
        rows = oracle.rows(job["prompt"], job["response"])
        out["shortfall"] = check_response_rows(rows, len(job["prompt"]), job["response"], "transformers SDPA reference")
        out["logprob_diff"] = check_served_logprobs(rows, job["response"], job["logprobs"],
                                                    "transformers SDPA reference")
        out["result"] = "pass"
    except OracleMismatch as e:
        out["result"], out["mismatch"] = "MISMATCH", str(e)
    out.update(seconds=time.perf_counter() - began, loaded_rss=loaded, peak_rss=_high_water())
    print(json.dumps(out))


def _oracle(model_dir: str, prompt: list[int], response: list[int], logprobs: list[float]) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompt": prompt, "response": response, "logprobs": logprobs}, f)
    try:
        run = subprocess.run([sys.executable, "-m", "pdserve.bench.scenarios.long_prompt", "--oracle-child", model_dir, f.name],
                             capture_output=True, text=True, cwd=CHECKOUT)
    finally:
        os.unlink(f.name)
    if run.returncode != 0:
        raise RuntimeError(f"the oracle's process exited with {run.returncode}:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def _stream(target: str, prompt: list[int], max_tokens: int) -> tuple[list[float], list[int], list[float]]:
    """One greedy request through the gateway's gRPC API: (seconds from the send to each token, token ids, their
    served logprobs)."""
    import grpc

    from pdserve.client import build_request
    from pdserve.common.proto import gateway_pb2_grpc

    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)  # connected before the clock starts
        req = build_request(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        times, ids, lps = [], [], []
        sent = time.perf_counter()
        for r in gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=1800.0):
            now = time.perf_counter()
            for tok, lp in zip(r.token_ids, r.logprobs):
                times.append(now - sent)
                ids.append(tok)
                lps.append(lp.logprob)
    return times, ids, lps


def _counted(after: dict, before: dict, name: str) -> float:
    return sum(v for (n, _), v in delta(after, before).items() if n == name)


def run(prompt_len: int, max_tokens: int, pass_tokens: int, seed: int) -> dict:
    model = ensure_model("long")
    context = prompt_len + 1024
    log(f"long preset, prompt {prompt_len} tokens, {max_tokens} generated, context and pools {context} tokens, "
        f"float32, prefill passes of {pass_tokens} tokens")
    extra = {"prefill": ["--dtype", "float32", "--prefill-max-batch-tokens", str(pass_tokens)],
             "decode": ["--dtype", "float32", "--allocation-timeout", "1800"],
             # the 60 s defaults bound a hung service; a 32k prefill on 2 busy cores takes about that long
             "gateway": ["--prefill-timeout", "1800", "--token-timeout", "1800"]}
    procs = launcher.start_stack(model, context_length=context, prefill_pool_tokens=context,
                                 decode_pool_tokens=context, extra=extra)
    try:
        r = random.Random(seed)
        prompt = [r.randrange(2, 512) for _ in range(prompt_len)]
        ports = {name: procs[name][0].metrics_port for name in ("prefill", "decode")}
        before = {name: scrape(port) for name, port in ports.items()}
        pids = [p.popen.pid for ps in procs.values() for p in ps]
        c0 = machine_cpu_seconds() - time.process_time() - sum(map(cpu_seconds, pids)), time.perf_counter()
        times, ids, lps = _stream(procs["gateway"][0].target, prompt, max_tokens)
        c1 = machine_cpu_seconds() - time.process_time() - sum(map(cpu_seconds, pids)), time.perf_counter()
        # cores kept busy by everything but the stack and this client: on a shared host a TTFT means little without
        other_cores = max(0.0, c1[0] - c0[0]) / (c1[1] - c0[1])
        after = {name: scrape(port) for name, port in ports.items()}
    finally:
        launcher.stop_stack(procs)
    if len(ids) != max_tokens:
        raise RuntimeError(f"the request ended after {len(ids)} of {max_tokens} tokens")
    itls = sorted(b - a for a, b in zip(times, times[1:]))
    out = {"prompt": prompt_len, "max_tokens": max_tokens, "ttft_s": times[0], "wall_s": times[-1],
           "itl_p50_ms": 1e3 * itls[len(itls) // 2] if itls else float("nan"),
           "prefill_passes": _counted(after["prefill"], before["prefill"], "pdserve_prefill_batch_sequences_count"),
           "kv_bytes": _counted(after["prefill"], before["prefill"], "pdserve_kv_transfer_bytes_total"),
           "violations": _counted(after["decode"], before["decode"], "pdserve_lease_violations_total"),
           "other_load_cores": other_cores}
    log(f"served: TTFT {out['ttft_s']:.1f} s, ITL p50 {out['itl_p50_ms']:.1f} ms; the reference runs ...")
    out["oracle"] = _oracle(model, prompt, ids, lps)
    with open(os.path.join(model, "config.json")) as f:
        heads = json.load(f)["num_attention_heads"]
    # eager attention: softmax(QK^T) for every head at once, [heads, T, T] float32, in one layer
    out["eager_scores_bytes"] = heads * (prompt_len + max_tokens) ** 2 * 4
    return out


def report(r: dict) -> str:
    o = r["oracle"]
    verdict = (f"every token passes (rule 1e-3: largest shortfall under the arg-max {o['shortfall']:.2e}, largest "
               f"served logprob's difference {o['logprob_diff']:.2e})" if o["result"] == "pass"
               else f"MISMATCH: {o['mismatch']}")
    return "\n".join([
        "| prompt | generated | TTFT s | ITL p50 ms | prefill passes | KV bytes moved | lease violations "
        "| other load |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {r['prompt']} | {r['max_tokens']} | {r['ttft_s']:.2f} | {r['itl_p50_ms']:.1f} | {r['prefill_passes']:.0f} "
        f"| {r['kv_bytes']:.0f} | {r['violations']:.0f} | {r['other_load_cores']:.1f} cores |",
        "",
        f"oracle (transformers SDPA, float32, {o['threads']} threads, own process): {verdict}; "
        f"{o['seconds']:.1f} s; peak RSS {o['peak_rss'] / MiB:.0f} MiB ({(o['peak_rss'] - o['loaded_rss']) / MiB:.0f} "
        f"MiB above the loaded model); eager attention's scores alone would be "
        f"{r['eager_scores_bytes'] / 2**30:.1f} GiB a layer"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m pdserve.bench.scenarios.long_prompt")
    ap.add_argument("--prompt", type=int, default=32768, help="prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated, each checked by the oracle")
    ap.add_argument("--pass-tokens", type=int, default=2048, help="prefill's --prefill-max-batch-tokens")
    ap.add_argument("--seed", type=int, default=19)
    ap.add_argument("--out", default=os.path.join(RESULTS, "long-prompt"),
                    help="writes OUT.md (the table) and OUT.json (every number); '' for neither")
    ap.add_argument("--oracle-child", nargs=2, metavar=("MODEL", "JOB"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.oracle_child:
        _oracle_child(*args.oracle_child)
        return 0
    r = run(args.prompt, args.max_tokens, args.pass_tokens, args.seed)
    text = report(r)
    print(text, flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(f"{args.out}.md", "w") as f:
            f.write(f"# One long prompt through the stack (python -m pdserve.bench.scenarios.long_prompt)\n\n{text}\n")
        with open(f"{args.out}.json", "w") as f:
            json.dump(r, f, indent=1)
    return 0 if r["oracle"]["result"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
