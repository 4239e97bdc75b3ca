"""Llama decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV pool.

Module and parameter names match Hugging Face checkpoint keys, so loading is a name mapping.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .context import get_context


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, D]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, D]
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.num_queries_per_kv = cfg.num_queries_per_kv
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        # the pool view is handed in by the runner: [num_pages, 2, page_size, kv_heads, head_dim]
        self.kv_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]
        T = x.shape[0]
        q = apply_rope(self.q_proj(x).view(T, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(T, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        ctx = get_context()
        cache = self.kv_cache
        if cache is not None:
            cache[ctx.slot_pages, 0, ctx.slot_offsets] = k.to(cache.dtype)
            cache[ctx.slot_pages, 1, ctx.slot_offsets] = v.to(cache.dtype)
        if ctx.is_prefill:
            # one sequence from position 0: attend over its fresh K/V, causally
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        else:
            # one new token per sequence: read every page of the sequence from the pool
            B = ctx.page_tables.shape[0]
            # masked slots still hold whatever the page held before (pages are never zeroed, and padding
            # points at page 0): an inf there turns the masked score into inf + -inf = NaN, so they are
            # zeroed. Indexing K and V apart gives contiguous copies, so reshape and the fill need no more.
            hidden_slots = ~ctx.attn_mask[:, 0, 0, :, None, None]  # [B, S, 1, 1]
            ks = cache[ctx.page_tables, 0].view(B, -1, self.num_kv_heads, self.head_dim).masked_fill_(hidden_slots, 0)
            vs = cache[ctx.page_tables, 1].view(B, -1, self.num_kv_heads, self.head_dim).masked_fill_(hidden_slots, 0)
            # one query per sequence: grouped matmuls over the shared KV heads, no head repeat
            qg = q.view(B, self.num_kv_heads, self.num_queries_per_kv, self.head_dim)
            scores = torch.matmul(qg, ks.permute(0, 2, 3, 1).to(q.dtype)) * self.head_dim ** -0.5  # [B, kvh, g, S]
            scores = scores.masked_fill(hidden_slots.view(B, 1, 1, -1), float("-inf"))
            o = torch.matmul(torch.softmax(scores, dim=-1), vs.transpose(1, 2).to(q.dtype))  # [B, kvh, g, D]
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg)
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
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
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

    def bind_kv_pool(self, pool: torch.Tensor) -> None:
        # pool: [num_pages, num_layers, 2, page_size, kv_heads, D]; each layer gets a view, no copy
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.kv_cache = pool[:, i]
