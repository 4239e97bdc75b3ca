"""The physical floor beside every figure: the machine measured once per run, the model's work counted from its
config.json.

- Memory bandwidth: the best of COPY_REPS copies of a COPY_BYTES float32 tensor (far past the last-level cache),
  bytes read plus bytes written per second, on 1 and 2 torch threads.
- fp32 matmul peak: the best of MM_REPS `torch.mm` of MM_N × MM_N, 2·N³ FLOPs each, on 1 and 2 threads.
- A decode step reads every weight but the embedding table (of which it reads B rows; an untied lm_head is read
  whole) and the KV of its B sequences at their context: floor = bytes / bandwidth.
- A prefill of L tokens: 2 FLOPs per weight per token in the linear layers, the lm_head for the last position
  only, and attention's QKᵀ and AV over the causal half: 2 · 2 · layers · heads · head_dim · L(L+1)/2.
The probe runs in a child process, so that this client never holds torch's thread pool.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

COPY_BYTES, COPY_REPS = 256 << 20, 5
MM_N, MM_REPS = 1536, 5

_PROBE = """
import json, time, torch
out = {}
for threads in (1, 2):
    torch.set_num_threads(threads)
    x = torch.ones(%(copy)d // 4); y = torch.empty_like(x)
    best = min((lambda t0: (y.copy_(x), time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(%(reps)d))
    out[f"copy_bytes_per_s_{threads}t"] = 2 * %(copy)d / best
    del x, y
    a = torch.randn(%(n)d, %(n)d); b = torch.randn(%(n)d, %(n)d); a @ b
    best = min((lambda t0: (a @ b, time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(%(mm)d))
    out[f"matmul_flops_{threads}t"] = 2 * %(n)d ** 3 / best
out["torch"] = torch.__version__
print(json.dumps(out))
""" % {"copy": COPY_BYTES, "reps": COPY_REPS, "n": MM_N, "mm": MM_REPS}


def measure_machine() -> dict:
    """Bandwidth and matmul peak on 1 and 2 threads, with the machine's other load over the probe."""
    from .load import machine_seconds

    m0, t0 = machine_seconds()[0], time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"floor probe exited {out.returncode}: {out.stderr[-1500:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["busy_cores_during_probe"] = (machine_seconds()[0] - m0) / (time.perf_counter() - t0)
    return res


def machine() -> dict:
    """CPU model, cores, memory and kernel of this host."""
    model = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return {"cpu": model, "cores": os.cpu_count(), "memory_gib": round(mem_kib / 2**20, 1), "kernel": os.uname().release}


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def _shape(cfg: dict) -> tuple[int, int, int, int, int, int, int]:
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    return h, inter, layers, heads, kv_heads, h // heads, vocab


def linear_params_per_layer(cfg: dict) -> int:
    h, inter, _, heads, kv_heads, hd, _ = _shape(cfg)
    return h * heads * hd + 2 * h * kv_heads * hd + heads * hd * h + 3 * h * inter  # q, k, v, o, gate, up, down


def decode_step_bytes(cfg: dict, batch: int, context: int) -> int:
    """Bytes one decode step of `batch` sequences at `context` tokens each must read."""
    h, _, layers, _, kv_heads, hd, vocab = _shape(cfg)
    width = _DTYPE_BYTES[cfg.get("torch_dtype", "float32")]
    weights = layers * (linear_params_per_layer(cfg) + 2 * h) + h  # the norms too
    lm_head = vocab * h  # an lm_head is read whole, tied or not
    embedding_rows = 0 if cfg.get("tie_word_embeddings") else batch * h
    kv = batch * context * 2 * layers * kv_heads * hd
    return (weights + lm_head + embedding_rows + kv) * width


def prefill_flops(cfg: dict, prompt_len: int) -> float:
    """FLOPs of one prompt's forward pass (matmuls and attention; norms, rotary and activations left out)."""
    h, _, layers, heads, _, hd, vocab = _shape(cfg)
    linear = 2 * prompt_len * layers * linear_params_per_layer(cfg)
    attention = 2 * 2 * layers * heads * hd * prompt_len * (prompt_len + 1) / 2
    return linear + attention + 2 * h * vocab


def cell_floors(cfg: dict, probe: dict, prompt_len: int, out_tokens: int, decode: dict, prefill: dict,
                itl_p50: float, threads: int = 1) -> dict:
    """pdserve's decode step and prefill at one cell against the floors. decode/prefill: the deltas of
    pdserve_forward_seconds (sum, count) over the cell and the tokens decode produced (`tokens`)."""
    out: dict = {}
    steps, step_s = decode.get("count", 0.0), decode.get("sum", 0.0)
    bw = probe[f"copy_bytes_per_s_{threads}t"]
    if steps > 0:
        batch = max(1, round(decode.get("tokens", steps) / steps))
        context = prompt_len + out_tokens // 2
        floor = decode_step_bytes(cfg, batch, context) / bw
        out.update(decode_batch_mean=batch, decode_context=context, decode_floor_s=floor,
                   decode_step_s=step_s / steps, decode_step_over_floor=step_s / steps / floor,
                   itl_over_floor=itl_p50 / floor)
    n, secs = prefill.get("requests", 0), prefill.get("sum", 0.0)
    if n and secs > 0:
        fps = prefill_flops(cfg, prompt_len) * n / secs
        out.update(prefill_s_per_request=secs / n, prefill_flop_s=fps,
                   prefill_of_peak_1t=fps / probe["matmul_flops_1t"], prefill_of_peak_2t=fps / probe["matmul_flops_2t"])
    return out
