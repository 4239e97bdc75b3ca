"""`pdserve make-model`: writes a random Llama checkpoint in Hugging Face format.

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
from .make_tokenizer import VOCAB_SIZE, write_tokenizer
from .model import LlamaForCausalLM

PRESETS = {
    # a few million parameters: the embedded default, fast on two CPU cores
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, max_position_embeddings=4096),
    # ~107M parameters: for benchmarks
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=9, num_attention_heads=16,
                  num_key_value_heads=8, max_position_embeddings=4096),
}
def make_model(out: str, preset: str = "tiny", seed: int = 0) -> str:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    os.makedirs(out, exist_ok=True)
    write_tokenizer(out)
    raw = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB_SIZE,
               rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu", initializer_range=0.1,
               tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, torch_dtype="float32",
               attention_bias=False, mlp_bias=False, **PRESETS[preset])
    cfg = ModelConfig(**{k: raw[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                               "num_hidden_layers", "num_attention_heads",
                                               "num_key_value_heads", "max_position_embeddings")})
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    state = {}
    for name, p in model.state_dict().items():
        if name.endswith("norm.weight"):
            # not all ones, so a loader that drops norm weights is caught by the parity test
            state[name] = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            state[name] = 0.1 * torch.randn(p.shape, generator=gen)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 1}, f, indent=2)
    return out
