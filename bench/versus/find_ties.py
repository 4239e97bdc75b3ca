"""`python -m pdserve.bench.versus.find_ties --cell 1024x16 --position 21`: the near ties of a cell's greedy
outputs, for a run whose JSON kept no mismatched ids (which request diverged is then unknown, only its cell and
first differing output position).

Every prompt of the cell (protocol.prompts: every round and loop) is decoded greedily by pdserve's engine in
float32 (the model runner the services run, no services); the float64 reference then reads that output teacher
forced, and every output position whose float64 top-2 margin is under --under is listed, smallest first. A request
that diverged from vLLM at position k has its near tie there if it is one; the listed candidates are then judged as
a mismatch would be, pdserve's token against the float64 runner-up (or the arg-max, where pdserve's is not it):
what the verdict would be were the other system to pick that token there.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from ..harness.common import log
from .protocol import MIN_REQUESTS
from .systems import model_facts, tiny_long_context
from .ties import Reference, judge, prompt_of

TAGS = ("closed", "open", "closed-rerun", "open-rerun")


def _top2(row) -> tuple[int, float]:
    v, i = row.topk(2)
    return int(i[0]), float(v[0] - v[1])


def engine_greedy(runner, prompt: list[int], num: int) -> tuple[list[int], list[float]]:
    """pdserve's float32 greedy output (the prompt prefilled, then decoded one token a step) and its own top-2
    margin at each output position."""
    pages = list(range(-(-(len(prompt) + num) // runner.page_size)))
    tok, margin = _top2(runner.prefill(prompt, pages)[0])
    out, margins = [tok], [margin]
    while len(out) < num:
        pos = len(prompt) + len(out) - 1
        tok, margin = _top2(runner.decode([out[-1]], [pos], [pages])[0])
        out.append(tok)
        margins.append(margin)
    return out, margins


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.versus.find_ties", description=__doc__.split("\n\n")[0])
    p.add_argument("--cell", required=True, help="PROMPTxCONCURRENCY, e.g. 1024x16")
    p.add_argument("--rounds", default="0,1,2")
    p.add_argument("--tags", default=",".join(TAGS[:2]), help=f"loops to scan, of {', '.join(TAGS)}")
    p.add_argument("--requests", type=int, default=MIN_REQUESTS)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--under", type=float, default=1e-4,
                   help="list positions whose float64 top-2 margin is under this (ties.py's bound is ~1e-4 here)")
    p.add_argument("--position", type=int, default=-1, help="only this output position")
    p.add_argument("--json", default="", help="also write the candidates here")
    args = p.parse_args(argv)
    from pdserve.engine.runner import ModelRunner

    torch.set_num_threads(1)
    model = tiny_long_context()
    vocab = model_facts(model)["vocab_size"]
    prompt_len = int(args.cell.split("x")[0])
    runner = ModelRunner(model, num_pages=-(-(prompt_len + args.tokens) // 16) + 1, page_size=16, device="cpu")
    ref = Reference(model)
    found, t0 = [], time.perf_counter()
    for r in (int(x) for x in args.rounds.split(",")):
        for tag in args.tags.split(","):
            for i in range(args.requests):
                prompt = prompt_of(args.cell, r, tag, i, vocab)
                ours, engine_margins = engine_greedy(runner, prompt, args.tokens)
                rows = ref.rows(prompt + ours[:-1], torch.float64)[len(prompt) - 1:]
                top = rows.topk(2, -1)
                for k in range(args.tokens):
                    margin = float(top.values[k, 0] - top.values[k, 1])
                    if margin < args.under and args.position in (-1, k):
                        other = int(top.indices[k, 1] if int(top.indices[k, 0]) == ours[k] else top.indices[k, 0])
                        row32, row64 = ref.next_logits(prompt + ours[:k])
                        j = judge(row32, row64, ours[k], other, k, ("pdserve", "the runner-up"))
                        found.append({"cell": args.cell, "round": r, "tag": tag, "index": i, "margin64": margin,
                                      "engine_margin32": engine_margins[k], **j.as_dict()})
                        log(f"r{r} {tag} #{i} position {k}: float64 margin {margin:.3e}, pdserve's {ours[k]}, "
                            f"pdserve's own margin {engine_margins[k]:.3e}, fp64 picks {j.pick64}; another "
                            f"system picking {other} there: {j.verdict}")
            log(f"round {r} {tag}: {args.requests} prompts scanned, {time.perf_counter() - t0:.0f} s")
    found.sort(key=lambda x: x["margin64"])
    print(json.dumps(found, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
