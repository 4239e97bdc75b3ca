"""Prefill attention on the CPU kernel (csrc/prefill_attention.c), for whole prompts and chunks: a chunk that
continues a prompt attends to the prefix where it lies in the paged pool, with a causal offset, without copying the
prefix or building a mask; a whole prompt is a chunk with no prefix. The kernel runs in 16 lanes where the CPU has
AVX-512, else 8.

The kernel is part of the engine's one native library (native.py loads it). `supports` says whether it takes a
layer; where it does not (a pool on a GPU, no library, a head_dim that is not a multiple of 8) the model keeps the
torch path, which gathers the prefix and masks, and `why_not` gives the reason for its start-up line and its log.

The pass's row-wise ops run on the library too where it loads (`rows`): RoPE with the K/V write, RMSNorm and
SiLU(gate) * up, each one call over all rows in the calling thread. As torch ops each starts its thread team and
waits at its barrier, and on cores decode shares a team waits for whichever thread decode holds.
"""
from __future__ import annotations

import ctypes
import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from . import native

log = logging.getLogger(__name__)

DTYPE_CODES = native.DTYPE_CODES
ERRORS = {1: "a prefix page id outside the pool",
          2: "fewer prefix pages than the prefix needs, an empty chunk, or positions past 2^31",
          3: "a shape the kernel does not take (heads, head_dim or group)", 5: "out of memory",
          6: "16 lanes asked of a CPU without AVX-512"}
MAX_HEAD_DIM = 256  # as csrc/prefill_attention.c
MAX_GROUP = 64      # query heads per KV head: its block of query rows (BR)
SPLIT_MACS = 1 << 24  # a chunk's score products below which one thread computes it all (~0.15 ms)

_fn = None
_rows = None
_warned: set[str] = set()
_pool: ThreadPoolExecutor | None = None  # blocks of queries shared by torch's intra-op threads, when it has several
_pool_size = 0


def _kernel():
    global _fn
    if _fn is None:
        lib = native._load()
        if lib is None:
            return None
        fn = lib.pd_prefill_attention
        fn.restype = ctypes.c_int
        i64, i32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        fn.argtypes = [vp, vp, vp, i64, i64, i64, vp, i64, vp, i32, i64, i64, i64, i64, i64, i32, i32, i32, i32, vp,
                       i64, i64, i32, i32, ctypes.c_float, i32, ctypes.POINTER(ctypes.c_int64)]
        _fn = fn
    return _fn


def rows():
    """The library's row-wise kernels, or None where it does not load (the model keeps torch's ops)."""
    global _rows
    if _rows is None:
        lib = native._load()
        if lib is None:
            return None
        i64, i32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        lib.pd_prefill_rope_kv.restype = i32
        lib.pd_prefill_rope_kv.argtypes = [vp, i64, i64, vp, vp, vp, i32, i64, i64, i64, i64, i64, vp, vp, i32, i32,
                                           i32, i32]
        lib.pd_rms_norm.restype = None
        lib.pd_rms_norm.argtypes = [vp, vp, ctypes.c_float, vp, i32, i64]
        lib.pd_silu_mul.restype = None
        lib.pd_silu_mul.argtypes = [vp, vp, i32, i64]
        _rows = lib
    return _rows


def _plain(*ts: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in ts)


def rope_kv_supported(qkv: torch.Tensor, cos: torch.Tensor, cache: torch.Tensor | None) -> bool:
    return cache is not None and cache.device.type == "cpu" and cache.dtype in (torch.float32, torch.bfloat16) \
        and cache.stride(-1) == 1 and qkv.dim() == 2 and _plain(qkv, cos) and rows() is not None


def rope_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor, slot_pages: torch.Tensor,
            slot_offsets: torch.Tensor, num_heads: int) -> None:
    """RoPE on q and k of the fused projection's rows qkv [T, (H + 2 kvh) * D], in place, then each token's K and V
    into its slot (slot_pages[t], slot_offsets[t]) of a layer's pool view [num_pages, 2, ps, kvh, D]; the same
    floats as apply_rope and the indexed write (csrc/paged_attention.c's rope)."""
    T = qkv.shape[0]
    kvh, D = cache.shape[3], cache.shape[4]
    if qkv.shape[1] != (num_heads + 2 * kvh) * D:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [T, (H + 2 kvh) * D] for {num_heads} heads over {kvh}")
    pages, offsets = (t.to(torch.int64).contiguous() for t in (slot_pages, slot_offsets))
    sin = sin.contiguous()
    rc = rows().pd_prefill_rope_kv(qkv.data_ptr(), T, qkv.stride(0), cos.data_ptr(), sin.data_ptr(), cache.data_ptr(),
                                   DTYPE_CODES[cache.dtype], cache.shape[0], cache.stride(0), cache.stride(1),
                                   cache.stride(2), cache.stride(3), pages.data_ptr(), offsets.data_ptr(),
                                   cache.shape[2], kvh, num_heads, D)
    if rc != 0:
        raise ValueError(f"prefill's K/V write refused {T} slots in a pool of {cache.shape[0]} pages of "
                         f"{cache.shape[2]}: {native.ERRORS.get(rc, f'error {rc}')}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm over x's last dimension on the library, or None where it does not take x (torch's op then)."""
    if not _plain(x, weight) or x.shape[-1] != weight.numel() or rows() is None:
        return None
    y = torch.empty_like(x)
    rows().pd_rms_norm(x.data_ptr(), weight.data_ptr(), eps, y.data_ptr(), x.numel() // weight.numel(),
                       weight.numel())
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """SiLU(gate) * up of the fused projection's rows [T, 2 I] on the library, or None where it does not take them."""
    if gate_up.dim() != 2 or not _plain(gate_up) or rows() is None:
        return None
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    act = torch.empty(T, I)
    rows().pd_silu_mul(gate_up.data_ptr(), act.data_ptr(), T, I)
    return act


def why_not(cache: torch.Tensor, num_heads: int) -> str | None:
    """None when the kernel takes this layer's pool view [num_pages, 2, ps, kvh, D], else why not."""
    if cache.device.type != "cpu":
        return f"the pool is on {cache.device.type}"
    if cache.dtype not in DTYPE_CODES:
        return f"a pool of {cache.dtype}"
    if cache.stride(-1) != 1:
        return "a pool whose head_dim is not contiguous"
    _, _, _, kvh, d = cache.shape
    if d % 8 or d > MAX_HEAD_DIM:
        return f"head_dim {d} (the kernel takes multiples of 8 up to {MAX_HEAD_DIM})"
    if num_heads % kvh or num_heads // kvh > MAX_GROUP:
        return f"{num_heads} query heads over {kvh} KV heads"
    if _kernel() is None:
        return f"no native library ({native.status()})"
    return None


def supports(cache: torch.Tensor, num_heads: int) -> bool:
    reason = why_not(cache, num_heads)
    if reason is not None and reason not in _warned:
        _warned.add(reason)  # once per reason: the path is slower, never different in what it computes
        log.warning("prefill attention: torch path (SDPA; a chunk gathers its prefix and masks): %s", reason)
    return reason is None


def status(cache: torch.Tensor, num_heads: int) -> str:
    """One line for the start-up log: which prefill attention runs, and why."""
    reason = why_not(cache, num_heads)
    if reason is None:
        return "prefill attention: native CPU kernel, a chunk's prefix read in place"
    return f"prefill attention: torch path (SDPA), a chunk's prefix gathered and masked ({reason})"


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                      prefix_pages: torch.Tensor, prefix_len: int, lanes: int = 0) -> torch.Tensor:
    """q: [L, H, D]; k, v: [L, kvh, D], the chunk's own keys (after RoPE) and values (any token stride); cache: a
    layer's pool view [num_pages, 2, ps, kvh, D] whose pages prefix_pages ([>= ceil(prefix_len / ps)] int64, in
    order) hold positions 0 .. prefix_len - 1. Query i sits at position prefix_len + i and sees keys
    0 .. prefix_len + i. Returns [L, H, D] in q's dtype; the arithmetic is float32. lanes: the kernel's vector
    width, 0 for the widest the CPU runs (16 with AVX-512, else 8); both widths give the same floats."""
    L, H, D = q.shape
    # read where the projection left them (views of its one output) when float32 with each token's heads in a row
    qf, kf, vf = (t if t.dtype == torch.float32 and t.stride(2) == 1 and t.stride(1) == D else t.float().contiguous()
                  for t in (q, k, v))
    pages = prefix_pages.contiguous()
    if pages.dtype != torch.int64 or pages.device.type != "cpu":
        raise ValueError(f"prefix pages must be int64 on the CPU, got {pages.dtype} on {pages.device}")
    out = torch.empty(L, H, D)
    kvh = cache.shape[3]
    fn = _kernel()

    # every head; with `shared`, the blocks go to whichever thread takes them next. ctypes drops the GIL for the
    # call: threads run side by side
    def call(shared=None) -> int:
        return fn(qf.data_ptr(), kf.data_ptr(), vf.data_ptr(), qf.stride(0), kf.stride(0), vf.stride(0),
                  out.data_ptr(), L, cache.data_ptr(), DTYPE_CODES[cache.dtype], cache.shape[0], cache.stride(0),
                  cache.stride(1), cache.stride(2), cache.stride(3), cache.shape[2], kvh, H, D, pages.data_ptr(),
                  pages.numel(), prefix_len, 0, kvh, D ** -0.5, lanes, shared)

    # a split costs a hand-off to the pool's threads and back (~0.1 ms): worth it only for a larger product
    n = torch.get_num_threads() if L * (prefix_len + (L + 1) // 2) * H * D >= SPLIT_MACS else 1
    if n > 1:
        global _pool, _pool_size
        if _pool_size < n:
            _pool, _pool_size = ThreadPoolExecutor(n, thread_name_prefix="prefill-attention"), n
        # the threads share the blocks of queries through one counter (not a fixed share each): one that decode
        # or anything else holds back takes fewer, rather than the pass waiting for its share
        shared = ctypes.pointer(ctypes.c_int64(0))
        rc = next((r for r in _pool.map(lambda _: call(shared), range(n)) if r != 0), 0)
    else:
        rc = call()
    if rc != 0:
        raise ValueError(f"prefill attention refused a chunk of {L} tokens after {prefix_len} on "
                         f"{pages.numel()} pages of {cache.shape[2]} (pool of {cache.shape[0]} pages): "
                         f"{ERRORS.get(rc, f'error {rc}')}")
    return out.to(q.dtype)
