"""Loads a Hugging Face checkpoint (single or sharded safetensors) into CausalLM, strictly.

Every model tensor must be in the files with its shape and every tensor in the files must be used: a tensor
left over means the checkpoint computes something this engine does not (a bias, a norm, an expert), and
serving without it would give wrong logits with no error. Nothing is loaded unless everything matches.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

from .config import CheckpointError, ModelConfig
from .model import CausalLM
from .rope import RotaryEmbedding

SHOWN = 5  # names quoted per kind of mismatch; the count says how many there are


def _weight_files(path: str) -> list[str]:
    """The files transformers reads: the shards the index names, else model.safetensors. Other
    *.safetensors beside them (a hub repo's consolidated.safetensors, a stray copy) are not the checkpoint."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json under {path}: run "
                                f"`pdserve make-model --out {path}`")
    return [single]


def _listed(kind: str, names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return f"{len(names)} tensors {kind}: {', '.join(names[:SHOWN])}{more}"


def check_tensors(cfg: ModelConfig, expected: dict[str, torch.Size], state: dict[str, torch.Tensor]) -> None:
    """Raises CheckpointError naming missing, extra, mis-shaped and non-float tensors (first few + counts)."""
    missing = sorted(expected.keys() - state.keys())
    extra = sorted(state.keys() - expected.keys())
    shapes = [f"{k} {list(state[k].shape)} (model: {list(expected[k])})" for k in sorted(expected.keys() & state.keys())
              if state[k].shape != expected[k]]
    ints = [f"{k} ({state[k].dtype})" for k in sorted(state) if not state[k].is_floating_point()]
    problems = [_listed(kind, names) for kind, names in (
        ("the model needs are missing (checkpoint lacks them)", missing),
        ("in the checkpoint are not used by the model (unsupported weights)", extra),
        ("have the wrong shape", shapes), ("are not floating point (quantized checkpoints are unsupported)", ints))
        if names]
    if problems:
        raise CheckpointError(f"{cfg.path}: checkpoint does not match {cfg.family} "
                              f"({cfg.num_hidden_layers} layers): " + "; ".join(problems))


def _check_saved_inv_freq(path: str, state: dict[str, torch.Tensor], ours: torch.Tensor) -> None:
    """Older Llama conversions saved each layer's rotary `inv_freq` buffer, which the config determines: it is
    taken out of the state, but only when it equals the frequencies computed from the config (a checkpoint that
    saved others was made with a rope the config does not describe)."""
    for name in [k for k in state if k.endswith(".rotary_emb.inv_freq")]:
        saved = state.pop(name)
        if saved.shape != ours.shape or not torch.allclose(saved.float(), ours, rtol=1e-3, atol=0):
            gap = float((saved.float() - ours).abs().max()) if saved.shape == ours.shape else float("nan")
            raise CheckpointError(f"{path}: {name} {list(saved.shape)} differs from the rotary frequencies config.json "
                                  f"describes ({list(ours.shape)}, largest difference {gap:.3g}): the checkpoint was "
                                  "made with a rope the config does not state")


def load_model(path: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> CausalLM:
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = CausalLM(cfg)
    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        state.update(load_file(f))
    emb = state.get("model.embed_tokens.weight")
    if cfg.tie_word_embeddings and emb is not None:
        # tied: lm_head is the embedding; a checkpoint may still carry the same tensor under lm_head
        head = state.get("lm_head.weight")
        if head is not None and not (head.shape == emb.shape and torch.equal(head, emb)):
            raise CheckpointError(f"{path}: tie_word_embeddings is true but lm_head.weight differs from "
                                  "model.embed_tokens.weight")
        state["lm_head.weight"] = emb
    # rotary inv_freq is a non-persistent buffer (on meta so far): rebuild it, in float32 as transformers does
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    _check_saved_inv_freq(path, state, rope.inv_freq)
    check_tensors(cfg, {k: v.shape for k, v in model.state_dict().items()}, state)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True, strict=True)
    model.model.rotary_emb = rope
    return model.to(device).eval()
