"""Model configuration read from a Hugging Face `config.json` (Llama architecture)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    head_dim: int = 0
    name: str = "model"
    path: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        arch = raw.get("architectures") or ["LlamaForCausalLM"]
        if raw.get("model_type", "llama") != "llama" and "LlamaForCausalLM" not in arch:
            raise ValueError(f"{path}: model_type {raw.get('model_type')!r} is not a Llama checkpoint")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"{path}: rope_type {rope_type!r} is not supported (only default RoPE)")
        theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
        eos = raw.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos,
            head_dim=raw.get("head_dim") or 0,
            name=os.path.basename(os.path.normpath(path)),
            path=path,
            extra=raw,
        )
