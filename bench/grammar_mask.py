"""What structured output costs per decode step, side by side in one run (a script, not a test):

1. per constrained row: the grammar's mask (llguidance, the state after each token of a schema's output), its
   application to the row's logits, and the token fed back, on the tiny checkpoint's 512-token vocabulary and on a
   32,000-token byte-level BPE trained here;
2. what unconstrained rows pay: `sample` over an all-greedy batch with this sampler against the one before the
   options (the main branch's, loaded from --before), and beside one constrained row;
3. a whole small decode step on the tiny model (forward + sampling) with 0 and 1 of 8 rows constrained, the
   mask computed after the forward pass (as decode does) or on a thread of its own while it runs.

    .venv/bin/python -m pdserve.bench.grammar_mask [--before ../main/services/engine/sampler.py]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from pdserve.engine.grammar import Grammars, GrammarSpec, apply_mask, fill
from pdserve.engine.sampler import SamplingParams, advance, sample

SCHEMA = json.dumps({"type": "object", "properties": {
    "ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 1000}, "note": {"type": "string", "maxLength": 40}},
    "required": ["ok", "colour", "count", "note"], "additionalProperties": False})


def _us(samples: list[float]) -> str:
    return f"median {statistics.median(samples) * 1e6:8.1f} us, p90 {sorted(samples)[int(len(samples) * .9)] * 1e6:8.1f} us"


def big_tokenizer(out_dir: str, vocab: int = 32000) -> str:
    """A byte-level BPE of `vocab` ids trained on the Python standard library's source (text at hand offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    import sysconfig
    root = sysconfig.get_paths()["stdlib"]
    files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".py")][:1500]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = os.path.join(out_dir, "tokenizer.json")
    tok.save(path)
    return path


def per_row(path: str, vocab: int, runs: int = 8) -> None:
    """Mask, apply and advance for one constrained row, at every step of sampled outputs of SCHEMA."""
    grammars = Grammars(path, vocab, [1])
    t = time.perf_counter()
    grammars.compile(GrammarSpec(SCHEMA))
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    grammars.start(GrammarSpec(SCHEMA))
    start_s = time.perf_counter() - t
    masks, applies, accepts, steps = [], [], [], 0
    g = torch.Generator().manual_seed(0)
    for run in range(runs):
        state = grammars.start(GrammarSpec(SCHEMA))
        while not state.is_done and steps < 5000:
            x = torch.randn(1, vocab, generator=g) * 3
            t0 = time.perf_counter()
            m = fill([state], vocab)
            t1 = time.perf_counter()
            apply_mask(x, m)
            t2 = time.perf_counter()
            tok = int(torch.multinomial(torch.softmax(x[0], -1), 1, generator=g))
            t3 = time.perf_counter()
            assert state.accept(tok) is None
            t4 = time.perf_counter()
            masks.append(t1 - t0)
            applies.append(t2 - t1)
            accepts.append(t4 - t3)
            steps += 1
    print(f"vocab {vocab}: compile (first, tokenizer included) {compile_s * 1e3:.0f} ms, a request's copy "
          f"{start_s * 1e6:.0f} us; {steps} steps of {runs} outputs")
    print(f"  mask (llguidance)   {_us(masks)}")
    print(f"  apply to the logits {_us(applies)}")
    print(f"  feed the token back {_us(accepts)}")


def _old_sampler(path: str):
    spec = importlib.util.spec_from_file_location("sampler_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sampler_before"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def unconstrained(before: str | None, vocab: int = 32000, batch: int = 8, reps: int = 2000) -> None:
    logits = torch.randn(batch, vocab)
    plain = [SamplingParams() for _ in range(batch)]

    mixed = plain[:-1] + [SamplingParams(grammar=GrammarSpec(json_object=True))]
    mask = {batch - 1: torch.full(((vocab + 31) // 32,), -1, dtype=torch.int32)}
    runs = {"this sampler, all greedy": lambda: sample(logits, plain, [3] * batch),
            f"this sampler, {batch - 1} greedy + 1 constrained": lambda: sample(logits, mixed, [3] * batch, masks=mask)}
    if before:
        old = _old_sampler(before)
        old_plain = [old.SamplingParams() for _ in range(batch)]
        runs["before the options, all greedy"] = lambda: old.sample(logits, old_plain, [3] * batch)
    took: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):  # interleaved, so that a busy moment of the machine hits every variant alike
        for name, fn in runs.items():
            t = time.perf_counter()
            fn()
            took[name].append(time.perf_counter() - t)
    for name, samples in took.items():
        print(f"sample(), {batch} rows of {vocab} logits, {name + ':':38s} {_us(samples)}")


def step(model_dir: str, batch: int = 8, steps: int = 300) -> None:
    """runner.decode + sampling for `batch` sequences: none constrained, or the last one with its mask computed
    on a thread of its own while the forward pass runs, or after it (interleaved step by step)."""
    from pdserve.engine.runner import ModelRunner
    runner = ModelRunner(model_dir, num_pages=batch * 24, page_size=16, device="cpu")
    vocab = runner.config.vocab_size
    grammars = Grammars(os.path.join(model_dir, "tokenizer.json"), vocab, [1])
    r = random.Random(0)
    prompts = [[r.randrange(2, 512) for _ in range(20)] for _ in range(batch)]
    tables = [list(range(i * 24, (i + 1) * 24)) for i in range(batch)]
    firsts = [int(runner.prefill(p, t[:2])[-1].argmax()) for p, t in zip(prompts, tables)]
    pool = ThreadPoolExecutor(1)
    spec = GrammarSpec(SCHEMA)
    plain = [SamplingParams() for _ in range(batch)]
    params = plain[:-1] + [SamplingParams(grammar=spec)]
    state = {"v": grammars.start(spec)}

    def one(variant: str, toks, pos):
        if state["v"].is_done:  # a fresh output, so that every step is a constrained one
            state["v"] = grammars.start(spec)
        states = {batch - 1: state["v"]} if variant != "none" else {}
        fut = pool.submit(fill, list(states.values()), vocab) if variant == "overlapped" else None
        logits = runner.decode(toks, pos, tables)
        masks = fut.result() if fut else fill(list(states.values()), vocab) if states else None
        out = sample(logits, params if states else plain, [1] * batch,
                     masks=dict(zip(states, masks)) if states else None)
        advance(states, out)
        return out

    took: dict[str, list[float]] = {"none": [], "overlapped": [], "after the forward": []}
    toks, pos = list(firsts), [20] * batch
    for _ in range(steps):
        for variant in took:
            t = time.perf_counter()
            out = one(variant, toks, pos)
            took[variant].append(time.perf_counter() - t)
        toks, pos = out, [p + 1 if p < 300 else 20 for p in pos]
    for variant, samples in took.items():
        print(f"decode step, tiny model, {batch} rows, mask of 1 row {variant + ':':19s} {_us(samples)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/pdserve-tiny")
    ap.add_argument("--before", default=None, help="a sampler.py from before the options, to compare with")
    args = ap.parse_args()
    torch.set_num_threads(1)
    per_row(os.path.join(args.model, "tokenizer.json"), 512)
    with tempfile.TemporaryDirectory() as d:
        per_row(big_tokenizer(d), 32000)
    unconstrained(args.before)
    step(args.model)


if __name__ == "__main__":
    main()
