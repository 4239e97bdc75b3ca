"""The CPU kernels in csrc/: built with the host's C compiler, loaded with ctypes (which releases the GIL for
each call, so a step in the model's thread no longer waits for the event loop between ops).

- paged decode attention (paged_attention.c), alone or with the layer's rope and K/V write (the attention block);
- a whole decode step (decode_step.c, NativeDecoder): float32 Llama-family models, any number of sequences.

A build is named after the hash of its sources and flags, so a stale library is never loaded. It is looked for
(and built, when missing) first beside this file (`_native/`, where `make setup`, `pip install` and the images
build it), then in $PDSERVE_NATIVE_DIR or ~/.cache/pdserve/native. Where no compiler is at hand (or with
PDSERVE_NATIVE=0) the engine keeps its torch path and says so at start-up, with the reason (`status()`): slower,
the same arithmetic up to float32 rounding.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading

import torch

from .native_build import build, library_name, search_dirs

log = logging.getLogger(__name__)

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ERRORS = {1: "a page id outside the pool", 2: "a sequence longer than its page table, or empty",
          3: "a shape the kernel does not take (heads, head_dim, group or page size)",
          4: "a token id outside the vocabulary", 5: "out of memory"}
MAX_HEAD_DIM, MAX_HEADS, MAX_PAGE = 256, 128, 256  # as csrc/paged_attention.c

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why_not: str | None = None


def _load() -> ctypes.CDLL | None:
    global _lib, _why_not
    with _lock:
        if _lib is not None or _why_not is not None:
            return _lib
        if os.environ.get("PDSERVE_NATIVE", "1") == "0":
            _why_not = "PDSERVE_NATIVE=0"
            return None
        name, errors = library_name(), []
        path = next((p for d in search_dirs() if os.path.exists(p := os.path.join(d, name))), None)
        for d in ([] if path else search_dirs()):
            try:
                path = build(d)
                break
            except (OSError, RuntimeError) as e:
                errors.append(f"{d}: {e}")
        if path is None:
            _why_not = "could not build " + name + ": " + "; ".join(errors)
            return None
        _lib = declare(ctypes.CDLL(path))  # CDLL, not PyDLL: the GIL is released for each call
        return _lib


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Sets the kernels' argument and result types on a loaded build (also one loaded by hand, e.g. to compare
    two builds in one process); returns it."""
    fn = lib.pd_paged_decode_attention
    fn.restype = ctypes.c_int
    i64, i32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [vp, vp, vp, i32, i64, i64, i64, i64, i64, i32, i32, i32, i32, vp, i64, vp, i32, ctypes.c_float]
    block = lib.pd_decode_attention_block
    block.restype = ctypes.c_int
    block.argtypes = [vp, i64, vp, vp, vp, vp, vp, i32, i64, i64, i64, i64, i64, i32, i32, i32, i32, vp, i64, vp,
                      i32, ctypes.c_float]
    step = lib.pd_decode_step
    step.restype = ctypes.c_int
    step.argtypes = [ctypes.POINTER(_Model), vp, vp, vp, vp, i64, vp, i32, vp]
    return lib


def status() -> str:
    """One line for the start-up log: which decode attention runs, and why."""
    if _load() is not None:
        return "paged decode attention: native CPU kernel"
    return f"paged decode attention: torch path ({_why_not})"


def supports(cache: torch.Tensor, num_heads: int) -> bool:
    """Whether the kernel takes this layer view: on the CPU, a dtype it reads, shapes within its bounds."""
    if cache.device.type != "cpu" or cache.dtype not in DTYPE_CODES or cache.stride(-1) != 1:
        return False
    _, _, ps, kvh, d = cache.shape
    return d <= MAX_HEAD_DIM and ps <= MAX_PAGE and num_heads % kvh == 0 and num_heads <= MAX_HEADS \
        and _load() is not None


def paged_decode_attention(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor
                           ) -> torch.Tensor:
    """q: [B, H, D]; cache: a layer's pool view [num_pages, 2, ps, kvh, D]; table: [B, P] int64 page ids, each
    sequence's pages in order; lens: [B] int64 tokens each attends (its new token's position + 1, already in the
    pool). Returns [B, H, D] in q's dtype."""
    lib = _load()
    B, H, D = q.shape
    qf = q.float().contiguous()
    out = torch.empty_like(qf)
    table = table.contiguous()
    rc = lib.pd_paged_decode_attention(
        qf.data_ptr(), out.data_ptr(), cache.data_ptr(), DTYPE_CODES[cache.dtype], cache.shape[0],
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), cache.shape[2], cache.shape[3], H, D,
        table.data_ptr(), table.shape[1], lens.data_ptr(), B, D ** -0.5)
    _check(rc)
    return out.to(q.dtype)


def _check(rc: int) -> None:
    if rc != 0:
        raise ValueError(f"paged decode attention refused the step: {ERRORS.get(rc, f'error {rc}')}")


def supports_block(cache: torch.Tensor, num_heads: int, dtype: torch.dtype) -> bool:
    """Whether decode_attention_block takes this layer: float32 activations, a float32 or bfloat16 pool."""
    return dtype == torch.float32 and cache.dtype in (torch.float32, torch.bfloat16) and cache.shape[-1] % 2 == 0 \
        and supports(cache, num_heads)


def decode_attention_block(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                           table: torch.Tensor, lens: torch.Tensor, num_heads: int) -> torch.Tensor:
    """From the fused projection on: RoPE on q and k, the new K and V written into each sequence's slot
    lens[b] - 1 of its own pages, then paged attention. qkv: [B, (H + 2 kvh) * D] float32 (rows may be strided);
    cos, sin: [B, D] float32 (rope.py's: sin's first half negated); cache, table, lens: as paged_decode_attention.
    Returns [B, H, D] float32."""
    B = qkv.shape[0]
    D, kvh = cache.shape[4], cache.shape[3]
    if qkv.stride(1) != 1 or qkv.shape[1] != (num_heads + 2 * kvh) * D:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [B, (H + 2 kvh) * D] with contiguous rows")
    cos, sin, table = cos.contiguous(), sin.contiguous(), table.contiguous()
    q_rot = torch.empty(B, num_heads, D)
    out = torch.empty(B, num_heads, D)
    _check(_load().pd_decode_attention_block(
        qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), q_rot.data_ptr(), out.data_ptr(),
        cache.data_ptr(), DTYPE_CODES[cache.dtype], cache.shape[0], cache.stride(0), cache.stride(1),
        cache.stride(2), cache.stride(3), cache.shape[2], kvh, num_heads, D, table.data_ptr(), table.shape[1],
        lens.data_ptr(), B, D ** -0.5))
    return out


_f = ctypes.POINTER(ctypes.c_float)


class _Layer(ctypes.Structure):  # csrc/decode_step.c's pd_layer
    _fields_ = [(name, _f) for name in ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up",
                                        "gate_up_bias", "down", "down_bias")] + [("cache", ctypes.c_void_p)]


class _Model(ctypes.Structure):  # csrc/decode_step.c's pd_model
    _fields_ = [(name, ctypes.c_int) for name in ("num_layers", "hidden", "intermediate", "num_heads",
                                                  "num_kv_heads", "head_dim", "vocab", "page_size", "pool_dtype")] + \
               [("eps", ctypes.c_float), ("scale", ctypes.c_float)] + \
               [(name, ctypes.c_int64) for name in ("num_pages", "page_stride", "kv_stride", "token_stride",
                                                    "head_stride")] + \
               [("embed", _f), ("final_norm", _f), ("lm_head", _f), ("layers", ctypes.POINTER(_Layer))]


def _ptr(t: torch.Tensor | None):
    return None if t is None else ctypes.cast(t.data_ptr(), _f)


class NativeDecoder:
    """The model's decode step as one native call (csrc/decode_step.c): float32 weights of a Llama-family decoder
    without per-head q/k norms or sparse experts, its pool on the CPU in float32 or bfloat16. Holds the weights'
    addresses: build it after the weights are final (loaded and fused) and the pool bound."""

    @staticmethod
    def why_not(model, pool: torch.Tensor) -> str | None:
        """None when the native step takes this model and pool, else why not."""
        cfg = model.config
        layers = model.model.layers
        if _load() is None:
            return f"no native library ({_why_not})"
        if next(model.parameters()).dtype != torch.float32:
            return f"weights in {next(model.parameters()).dtype}, the native step takes float32"
        if cfg.qk_norm or cfg.moe_layers:
            return "per-head q/k norms or sparse experts"
        if any(layer.self_attn.qkv is None or layer.mlp.gate_up is None for layer in layers):
            return "projections that could not be fused"
        if not supports_block(pool[:, 0], cfg.num_attention_heads, torch.float32):
            return f"a pool of {pool.dtype} pages the attention kernel does not take"
        weights = [model.model.embed_tokens.weight, model.lm_head.weight]
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            weights += [a.qkv[0], a.o_proj.weight, m.gate_up[0], m.down_proj.weight]
        if not all(w.is_contiguous() for w in weights):
            return "weights that are not contiguous"
        return None

    def __init__(self, model, pool: torch.Tensor, lib: ctypes.CDLL | None = None):
        """lib: a build other than the one _load() picks (declare()d), e.g. to compare two in one process."""
        why = self.why_not(model, pool)
        if why is not None:
            raise ValueError(f"the native decode step does not take this model: {why}")
        cfg = model.config
        self.lib = lib or _load()
        layers = []
        keep = []
        for i, layer in enumerate(model.model.layers):
            a, m = layer.self_attn, layer.mlp
            tensors = (layer.input_layernorm.weight, a.qkv[0], a.qkv[1], a.o_proj.weight, a.o_proj.bias,
                       layer.post_attention_layernorm.weight, m.gate_up[0], m.gate_up[1], m.down_proj.weight,
                       m.down_proj.bias)
            keep += [t for t in tensors if t is not None]
            layers.append(_Layer(*[_ptr(t) for t in tensors], pool[:, i].data_ptr()))
        self.layers = (_Layer * len(layers))(*layers)
        view = pool[:, 0]
        self.model = _Model(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                            cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size, view.shape[2],
                            DTYPE_CODES[pool.dtype], cfg.rms_norm_eps, cfg.head_dim ** -0.5, view.shape[0],
                            view.stride(0), view.stride(1), view.stride(2), view.stride(3),
                            _ptr(model.model.embed_tokens.weight), _ptr(model.model.norm.weight),
                            _ptr(model.lm_head.weight), self.layers)
        self._keep = keep + [model.model.embed_tokens.weight, model.model.norm.weight, model.lm_head.weight, pool]

    def step(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, table: torch.Tensor,
             lens: torch.Tensor) -> torch.Tensor:
        """ids, lens: [B] int64; cos, sin: [B, D] float32; table: [B, P] int64. Returns logits [B, V] float32."""
        B = ids.shape[0]
        ids, cos, sin, table, lens = (t.contiguous() for t in (ids, cos, sin, table, lens))
        logits = torch.empty(B, self.model.vocab)
        _check(self.lib.pd_decode_step(ctypes.byref(self.model), ids.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                       table.data_ptr(), table.shape[1], lens.data_ptr(), B, logits.data_ptr()))
        return logits


def main() -> int:
    """`python -m pdserve.engine.native`: builds the library beside this file (make setup, the images) and says
    which decode attention the engine will run."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = build()
    except RuntimeError as e:
        print(f"native: {e}", file=sys.stderr)
        return 1
    print(f"native: built {path}; {status()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
