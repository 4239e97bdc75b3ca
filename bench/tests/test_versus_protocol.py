"""The side-by-side protocol's pure parts: the steady-state window, the round order, ratios and their spread, the
loaded flag, the open-loop rate, prompts, the token-id check, the floors' arithmetic and the folding of rounds."""
import json
import math
import os
import struct

import pytest

from pdserve.bench.harness.workload import Record
from pdserve.bench.versus import floors, protocol, report
from pdserve.bench.versus.protocol import Cell
from pdserve.bench.versus.systems import TINY, compare_ids


def _rec(arrival, times, error=None):
    r = Record(arrival, token_times=list(times), token_ids=[1] * len(times))
    r.error = error
    return r


def test_window_drops_the_first_and_last_c_requests_in_send_order():
    recs = [_rec(float(i), [i + 0.5, i + 0.75]) for i in range(9)]
    w = protocol.steady_window(list(reversed(recs)), 2)  # the order records come in does not matter
    assert [r.arrival for r in w.kept] == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert (w.start, w.end, w.seconds) == (2.0, 7.0, 5.0)
    # every token in [2, 7) counts, whichever request it belongs to; requests finished in it likewise
    assert protocol.tokens_in(recs, w.start, w.end) == 10
    assert protocol.finished_in(recs, w.start, w.end) == 5
    assert protocol.finished_in([_rec(3.0, [3.5], error="x")], 0.0, 9.0) == 0
    with pytest.raises(ValueError, match="4 requests leave none"):
        protocol.steady_window(recs[:4], 2)


def test_rounds_alternate_the_order():
    assert [protocol.round_order(["A", "B"], r) for r in range(4)] == [["A", "B"], ["B", "A"], ["A", "B"], ["B", "A"]]
    assert protocol.round_order(["A", "B", "C"], 1) == ["C", "B", "A"]


def test_a_cell_sends_64_requests_or_20_seconds_but_enough_for_its_window():
    assert protocol.keep_sending(63, 1.0, 1)
    assert not protocol.keep_sending(64, 1.0, 1)
    assert not protocol.keep_sending(10, 20.0, 1)
    assert protocol.keep_sending(47, 25.0, 16)  # 3 × 16 are needed for a window of 16
    assert not protocol.keep_sending(48, 25.0, 16)


def test_ratio_is_the_median_of_per_round_ratios_with_its_spread():
    assert protocol.ratio_spread([10.0, 30.0, 20.0], [10.0, 10.0, 10.0]) == (2.0, 1.0, 3.0)
    assert protocol.ratio_spread([10.0, math.nan, 12.0], [5.0, 5.0, 4.0]) == (2.5, 2.0, 3.0)  # round 2 skipped
    assert all(math.isnan(x) for x in protocol.ratio_spread([math.nan], [1.0]))
    assert protocol.better({"a": [1.0, 5.0, 6.0], "b": [4.0, 4.0, 4.0]}, higher_is_better=True) == "a"
    assert protocol.better({"a": [1.0, 5.0, 6.0], "b": [4.0, 4.0, 4.0]}, higher_is_better=False) == "b"


def test_loaded_flag():
    assert not protocol.loaded(0.1)
    assert protocol.loaded(0.11)
    assert protocol.loaded(math.nan)  # not known is not quiet


def test_open_loop_rate_and_size():
    assert protocol.open_loop_rate({"a": 10.0, "b": 4.0, "c": math.nan}) == pytest.approx(2.8)
    with pytest.raises(ValueError):
        protocol.open_loop_rate({"a": math.nan})
    assert protocol.open_loop_requests(2.0, 4) == 40
    assert protocol.open_loop_requests(0.1, 16) == 40   # 2 × 16 dropped, 8 kept
    assert protocol.open_loop_requests(100.0, 4) == 64
    a = protocol.poisson_offsets(2.0, 50, "s")
    assert a == protocol.poisson_offsets(2.0, 50, "s") and a == sorted(a) and a != protocol.poisson_offsets(2.0, 50, "t")


def test_prompts_are_shared_by_systems_and_distinct_across_cells_rounds_and_loops():
    a = protocol.prompts(Cell(128, 4), 0, "closed", 3, 512)
    assert a == protocol.prompts(Cell(128, 4), 0, "closed", 3, 512)
    assert all(len(p) == 128 and min(p) >= 2 and max(p) < 512 for p in a)
    others = [protocol.prompts(Cell(128, 1), 0, "closed", 3, 512), protocol.prompts(Cell(128, 4), 1, "closed", 3, 512),
              protocol.prompts(Cell(128, 4), 0, "open", 3, 512)]
    firsts = {tuple(p[:16]) for ps in [a, *others] for p in ps}  # a prefix cache matches whole 16-token pages
    assert len(firsts) == 12


def test_token_ids_are_compared_where_both_streamed():
    assert compare_ids([[5, 6, 7], [5, 6, 7], None, [1]], [[5, 6, 7], [5, 9, 7], [1, 2, 3]]) == {
        "compared": 2, "mismatched": 1, "first_divergence": 1}
    assert compare_ids([[5, 6]], [[5, 6, 7]]) == {"compared": 1, "mismatched": 1, "first_divergence": 2}


def _tensor_elements(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return {k: math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def test_decode_bytes_are_the_checkpoints_tensors_less_the_unread_embedding_rows():
    cfg = floors.config(TINY)
    elems = {}
    for name in os.listdir(TINY):
        if name.endswith(".safetensors"):
            elems.update(_tensor_elements(os.path.join(TINY, name)))
    emb = next(v for k, v in elems.items() if k.endswith("embed_tokens.weight"))
    h = cfg["hidden_size"]
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"]) * 4
    # batch 3 at context 100: all the weights but the embedding table, 3 of its rows, and 300 tokens of KV
    assert floors.decode_step_bytes(cfg, 3, 100) == (sum(elems.values()) - emb + 3 * h) * 4 + 300 * kv_per_token


def test_prefill_flops_grow_with_the_square_of_the_prompt_in_attention_only():
    cfg = floors.config(TINY)
    lin = 2 * floors.linear_params_per_layer(cfg) * cfg["num_hidden_layers"]
    attn = 4 * cfg["num_hidden_layers"] * cfg["hidden_size"]  # heads × head_dim = hidden
    head = 2 * cfg["hidden_size"] * cfg["vocab_size"]
    assert floors.prefill_flops(cfg, 1) == lin + attn + head
    assert floors.prefill_flops(cfg, 10) == 10 * lin + attn * 55 + head


def _fig(system, r, cell, loop, tok_s, ttft, cpu=0.1, loaded=False):
    p, c = (int(x) for x in cell.split("x"))
    return {"system": system, "round": r, "cell": cell, "prompt_len": p, "concurrency": c, "loop": loop,
            "final": True, "out_tok_s": tok_s, "ttft_p50": ttft, "itl_p50": 0.01, "cpu_s_per_request": cpu,
            "loaded": loaded}


def test_rounds_fold_into_ratios_against_the_better_vllm_per_figure():
    runs = []
    for r, (pd, v1, v2) in enumerate([(100.0, 80.0, 120.0), (110.0, 90.0, 100.0), (90.0, 70.0, 110.0)]):
        runs += [_fig("pdserve", r, "128x4", "closed", pd, 0.02, loaded=(r == 1)),
                 _fig("vLLM-CPU", r, "128x4", "closed", v1, 0.01),          # the faster first token
                 _fig("vLLM-CPU 2 cores", r, "128x4", "closed", v2, 0.04),  # the faster throughput
                 _fig("pdserve", r, "128x4", "open", 0, 0.03), _fig("vLLM-CPU", r, "128x4", "open", 0, 0.06),
                 _fig("vLLM-CPU 2 cores", r, "128x4", "open", 0, 0.05)]
    runs.append({**_fig("pdserve", 0, "128x4", "closed", 1.0, 9.9), "final": False})  # a re-run attempt replaced
    res = {"cells": ["128x4"], "rounds": 3, "runs": runs, "rates": {"128x4": 1.0}, "tokens": [],
           "systems": {"pdserve": {}, "vLLM-CPU": {}, "vLLM-CPU 2 cores": {}}, "config": {}, "floors": {},
           "protocol": {"output_tokens": 32}}
    row = report.analyse(res)[0]
    r = row["ratios"]["pdserve"]
    assert r["out_tok_s"]["against"] == "vLLM-CPU 2 cores"
    assert (r["out_tok_s"]["median"], r["out_tok_s"]["min"], r["out_tok_s"]["max"]) == pytest.approx(
        (100 / 120, 90 / 110, 1.1))
    assert r["ttft_p50"]["against"] == "vLLM-CPU" and r["ttft_p50"]["median"] == pytest.approx(2.0)
    assert r["open_ttft_p50"]["against"] == "vLLM-CPU 2 cores" and r["open_ttft_p50"]["median"] == pytest.approx(0.6)
    assert row["loaded"]
    verdicts = {t["figure"]: t["verdict"] for t in report.targets([row])}
    assert verdicts == {"out_tok_s": "MISSED", "open_ttft_p50": "met", "cpu_s_per_request": "met"}
