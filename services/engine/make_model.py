"""`pdserve make-model`: writes a random checkpoint of one family in Hugging Face format.

No weights can be downloaded here, so the default model is random. `initializer_range` 0.1 (not
the usual 0.02) makes the logits depend strongly on the context, so stale or foreign KV changes the
output and greedy decoding does not collapse into a loop.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from .config import ModelConfig
from .families import ARCHITECTURES, read_config
from .dtypes import DTYPES
from .make_tokenizer import VOCAB_SIZE, write_tokenizer
from .model import CausalLM

PRESETS = {
    # a few million parameters: the embedded default, fast on two CPU cores
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, max_position_embeddings=4096),
    # ~107M parameters: for benchmarks
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=9, num_attention_heads=16,
                  num_key_value_heads=8, max_position_embeddings=4096),
    # the incident's scale at tiny cost: a 1,048,576-token context (2,048 bytes of bf16 KV a token)
    "long": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, max_position_embeddings=1_048_576),
}
# the dtype a preset is written in unless one is named
PRESET_DTYPES = {"long": "bfloat16"}
# what each family adds to the Llama config, so its own tensors and keys are exercised
FAMILY_KEYS = {
    "llama": dict(attention_bias=False, mlp_bias=False),
    "mistral": dict(sliding_window=4096),
    "qwen2": dict(use_sliding_window=False, sliding_window=None, tie_word_embeddings=True),
    # head_dim 64 is not hidden_size / heads (32): Qwen3's explicit head_dim
    "qwen3": dict(attention_bias=False, head_dim=64),
    "qwen3_moe": dict(attention_bias=False, head_dim=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[0]),
}
MOE_INTERMEDIATE = {"tiny": 128, "small": 704, "long": 128}


def _config(arch: str, preset: str, dtype: str) -> dict:
    raw = dict(architectures=[ARCHITECTURES[arch]], model_type=arch, vocab_size=VOCAB_SIZE,
               rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu", initializer_range=0.1,
               tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, torch_dtype=dtype)
    if arch == "llama":  # the key order of the original default checkpoint, whose bytes must not change
        return dict(raw, **FAMILY_KEYS[arch], **PRESETS[preset])
    moe = dict(moe_intermediate_size=MOE_INTERMEDIATE[preset]) if arch == "qwen3_moe" else {}
    return dict(raw, **PRESETS[preset], **FAMILY_KEYS[arch], **moe)


def make_model(out: str, preset: str = "tiny", seed: int = 0, arch: str = "llama", dtype: str | None = None) -> str:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    dtype = dtype or PRESET_DTYPES.get(preset, "float32")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(ARCHITECTURES)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    raw = _config(arch, preset, dtype)
    cfg = ModelConfig(**read_config(raw))
    os.makedirs(out, exist_ok=True)
    write_tokenizer(out)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in CausalLM(cfg).state_dict().items():
        if name.endswith("norm.weight"):
            # not all ones, so a loader that drops norm weights is caught by the parity test
            state[name] = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            state[name] = 0.1 * torch.randn(p.shape, generator=gen)
    if cfg.tie_word_embeddings:
        del state["lm_head.weight"]
    save_file({k: v.to(DTYPES[dtype]).contiguous() for k, v in state.items()},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    # safetensors writes the file 0600 whatever the umask: a checkpoint made as root and mounted into a pod or
    # image that serves as another uid could not be read (found serving the CPU image as uid 10001)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(os.path.join(out, "model.safetensors"), 0o666 & ~umask)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 1}, f, indent=2)
    return out
