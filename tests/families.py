"""Tiny random checkpoints of each served family, written by transformers (not by pdserve), for the parity
and teacher-forcing tests: the independent path that checks pdserve's loader and model."""
from __future__ import annotations

import os
import shutil

import torch

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1)
# each family with the config features that distinguish it switched on
FAMILIES = {
    "llama": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "mistral": ("MistralConfig", dict(head_dim=16, sliding_window=512)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                         norm_topk_prob=True, mlp_only_layers=[1])),
}


def write_checkpoint(family: str, out: str, tokenizer_from: str, seed: int = 0) -> str:
    """Every parameter random (biases and norms too: transformers initialises those to 0 and 1, which a
    loader that drops them would still match), saved with save_pretrained, plus the tiny model's tokenizer."""
    import transformers

    cls, keys = FAMILIES[family]
    cfg = getattr(transformers, cls)(**TINY, **keys)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(out)
    shutil.copy(os.path.join(tokenizer_from, "tokenizer.json"), out)
    return out


def load_reference(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
