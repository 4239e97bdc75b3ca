"""The Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV pool, with the
variations of the families in families.py: attention and MLP biases, per-head q/k norms (Qwen3) and sparse
expert MLPs (Qwen3-MoE).

Module and parameter names match Hugging Face checkpoint keys, so loading is a name mapping.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .context import get_context
from . import native, native_prefill
from .moe import SparseMoeBlock
from .packed_linear import PackedAway, PackedLinear, linear, pack
from .paged_attention import paged_decode_attention
from .rope import RotaryEmbedding, apply_rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one call over every row where the native library takes x, else torch's one fused op; the same float32
            # arithmetic as below
            y = native_prefill.rms_norm(x, self.weight, self.eps)
            return y if y is not None else F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype  # transformers' order: normalised in float32, rounded, then scaled in the weights' dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One weight (and bias) for linears that read the same input, or None when some have a bias and others not;
    each linear's parameters become views of the fused ones, so the checkpoint's names still hold the tensors and
    no memory is added."""
    has_bias = {m.bias is not None for m in linears}
    if len(has_bias) > 1:
        return None
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = torch.cat([m.bias.detach() for m in linears]) if True in has_bias else None
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[row:row + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[row:row + n], requires_grad=False)
        row += n
    return weight, bias


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.num_queries_per_kv = cfg.num_queries_per_kv
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's q and k, before RoPE
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        # the pool view is handed in by the runner: [num_pages, 2, page_size, kv_heads, head_dim]
        self.kv_cache: torch.Tensor | None = None
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fuse(): q, k and v in one matmul

    def fuse(self) -> None:
        fused = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        self.qkv = fused

    def pack(self) -> None:
        """Its linears on oneDNN's packed weights (packed_linear.py), the plain ones dropped: prefill only."""
        if self.qkv is not None:
            self.qkv = (pack(self.qkv[0]), self.qkv[1])
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(self, name, PackedAway(name, "qkv"))
        else:
            self.q_proj, self.k_proj, self.v_proj = (PackedLinear(m) for m in (self.q_proj, self.k_proj, self.v_proj))
        self.o_proj = PackedLinear(self.o_proj)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, kvh, D] (normed, rotated later), v: [T, kvh, D]."""
        T, H, kvh, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv is None:
            return (self.q_proj(x).view(T, H, D), self.k_proj(x).view(T, kvh, D), self.v_proj(x).view(T, kvh, D))
        return self._split(linear(x, *self.qkv))

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        H, kvh = self.num_heads, self.num_kv_heads
        qkv = qkv.view(qkv.shape[0], H + 2 * kvh, self.head_dim)
        return qkv[:, :H], qkv[:, H:H + kvh], qkv[:, H + kvh:]

    def _rotated_and_stored(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (normed where the family norms them, rotated) and v, this pass's K and V written into the pool."""
        cache = self.kv_cache
        if ctx.is_prefill and self.qkv is not None and not self.qk_norm:
            qkv = linear(x, *self.qkv)
            if native_prefill.rope_kv_supported(qkv, cos, cache):
                native_prefill.rope_kv(qkv, cos, sin, cache, ctx.slot_pages, ctx.slot_offsets, self.num_heads)
                return self._split(qkv)
            q, k, v = self._split(qkv)
        else:
            q, k, v = self._project(x)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            cache[ctx.slot_pages, 0, ctx.slot_offsets] = k.to(cache.dtype)
            cache[ctx.slot_pages, 1, ctx.slot_offsets] = v.to(cache.dtype)
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]
        T = x.shape[0]
        ctx = get_context()
        cache = self.kv_cache
        if ctx.fused and self.qkv is not None and not self.qk_norm:
            # decode on the CPU kernel from the projection on: rope, the K/V write and attention in one call
            qkv = linear(x, *self.qkv)
            o = native.decode_attention_block(qkv, cos[:, 0], sin[:, 0], cache, ctx.table, ctx.lens, self.num_heads)
            return self.o_proj(o.view(T, self.num_heads * self.head_dim))
        q, k, v = self._rotated_and_stored(x, cos, sin, ctx)
        if ctx.is_prefill:
            # packed sequences, each attending only to itself: no padding, no [T, T] mask across the batch
            cu = ctx.cu_seqlens
            outs = [self._prefill_attention(q[a:b], k[a:b], v[a:b], ctx.prefix_pages[i], ctx.prefix_lens[i])
                    for i, (a, b) in enumerate(zip(cu, cu[1:]))]
            o = outs[0] if len(outs) == 1 else torch.cat(outs)
        elif ctx.table is not None:  # one new token per sequence, on the CPU kernel
            o = native.paged_decode_attention(q, cache, ctx.table, ctx.lens)
        else:
            o = paged_decode_attention(q, cache, ctx.paged)  # one new token per sequence
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))

    def _prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_pages: torch.Tensor,
                           prefix_len: int) -> torch.Tensor:
        """One sequence of a packed prefill: causal over its fresh K/V, after the prefix_len tokens that earlier
        chunks of it left in the pool (read back as decode reads them, so a chunked prompt equals a whole one)."""
        # q: [L, H, D]; k, v: [L, kvh, D] -> [L, H, D]
        mask = None
        if native_prefill.supports(self.kv_cache, self.num_heads):
            # the prefix read where it lies in the pool, causal by offset: no copy of it, no [L, P + L] mask; a
            # whole prompt on the same kernel (on AVX-512 about twice as fast as torch's flash attention at head_dim
            # 32), so a chunked prompt and a whole one do the same arithmetic
            return native_prefill.prefill_attention(q, k, v, self.kv_cache, prefix_pages, prefix_len)
        if prefix_len:  # the torch path (a pool on a GPU, no native library): native_prefill logs why, once
            L, kvh, D = q.shape[0], self.num_kv_heads, self.head_dim
            old = self.kv_cache[prefix_pages]  # [P, 2, ps, kvh, D], a copy of the prefix's pages
            k = torch.cat([old[:, 0].reshape(-1, kvh, D)[:prefix_len].to(k.dtype), k])
            v = torch.cat([old[:, 1].reshape(-1, kvh, D)[:prefix_len].to(v.dtype), v])
            # query i sits at position prefix_len + i: it sees keys 0 .. prefix_len + i
            mask = torch.ones(L, prefix_len + L, dtype=torch.bool, device=q.device).tril(prefix_len)
        return F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask, is_causal=mask is None, enable_gqa=True)[0].transpose(0, 1)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fuse(): gate and up in one matmul

    def fuse(self) -> None:
        self.gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def pack(self) -> None:
        """As LlamaAttention.pack."""
        if self.gate_up is not None:
            self.gate_up = (pack(self.gate_up[0]), self.gate_up[1])
            self.gate_proj, self.up_proj = PackedAway("gate_proj", "gate_up"), PackedAway("up_proj", "gate_up")
        else:
            self.gate_proj, self.up_proj = PackedLinear(self.gate_proj), PackedLinear(self.up_proj)
        self.down_proj = PackedLinear(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = linear(x, *self.gate_up)
        act = native_prefill.silu_mul(gate_up)  # one call over every row where the native library takes them
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = SparseMoeBlock(cfg, LlamaMLP) if layer_idx in cfg.moe_layers else \
            LlamaMLP(cfg, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden]
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def fuse(self) -> None:
        """Projections that read the same input become one matmul each (after loading: the parameters keep
        their checkpoint names, as views of the fused tensors)."""
        for m in self.modules():
            if isinstance(m, (LlamaAttention, LlamaMLP)):
                m.fuse()

    def pack(self) -> None:
        """Every projection on oneDNN's packed weights (after fuse; prefill only: decode's native step reads the
        plain layout). A head tied to the embedding keeps its plain weight: packing it would copy the embedding."""
        for m in list(self.modules()):
            if isinstance(m, (LlamaAttention, LlamaMLP)):
                m.pack()
        if self.lm_head.weight.data_ptr() != self.model.embed_tokens.weight.data_ptr():
            self.lm_head = PackedLinear(self.lm_head)

    def bind_kv_pool(self, pool: torch.Tensor) -> None:
        # pool: [num_pages, num_layers, 2, page_size, kv_heads, D]; each layer gets a view, no copy
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.kv_cache = pool[:, i]
