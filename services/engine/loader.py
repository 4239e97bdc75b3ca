"""Loads a Hugging Face Llama checkpoint (single or sharded safetensors) into LlamaForCausalLM."""
from __future__ import annotations

import glob
import json
import os

import torch
from safetensors.torch import load_file

from .config import ModelConfig
from .model import LlamaForCausalLM


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {path}: run `pdserve make-model --out {path}`")
    return files


def load_model(path: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
               ) -> LlamaForCausalLM:
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        state.update(load_file(f))
    if cfg.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    expected = set(model.state_dict().keys())
    missing = expected - state.keys()
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    state = {k: v.to(dtype) for k, v in state.items() if k in expected}
    model.load_state_dict(state, assign=True)
    # rotary inv_freq is a non-persistent buffer: rebuild it on the real device
    model.model.rotary_emb.__init__(cfg.head_dim, cfg.rope_theta)
    return model.to(device).eval()
