"""Model configuration read from a Hugging Face `config.json` (the families in families.py)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field


class CheckpointError(ValueError):
    """A checkpoint the engine cannot serve exactly as written: the CLI prints the message, no traceback."""


def weight_files(path: str) -> list[str]:
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
    # every id config.json lists as an end of sequence (Llama 3.x lists three); eos_token_id is the first
    eos_token_ids: tuple[int, ...] = ()
    head_dim: int = 0
    family: str = "llama"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # RoPE frequency scaling: {"rope_type": "llama3"|"linear", "factor": ..., ...}; empty for plain RoPE
    rope_scaling: dict = field(default_factory=dict)
    # positions at or past the sliding window would attend differently: the runner refuses them (0: no window)
    sliding_window: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    # config.json's torch_dtype: what the weights are served in unless --dtype says otherwise (None: not stated)
    torch_dtype: str | None = None
    name: str = "model"
    path: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}")
        if self.num_experts_per_tok > self.num_experts:
            raise CheckpointError(f"num_experts_per_tok {self.num_experts_per_tok} exceeds num_experts "
                                  f"{self.num_experts}")
        if self.sliding_window:
            # served context capped at the window, where sliding-window attention equals full attention
            self.max_position_embeddings = min(self.max_position_embeddings, self.sliding_window)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        from .families import read_config

        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        try:
            kw = read_config(raw)
        except CheckpointError as e:
            raise CheckpointError(f"{path}/config.json: {e}") from None
        # generate() (transformers) and vLLM also stop at generation_config.json's end-of-sequence ids, which for
        # instruct checkpoints name the end-of-turn token config.json may lack
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.exists(gen_path):
            with open(gen_path) as f:
                eos = json.load(f).get("eos_token_id")
            more = eos if isinstance(eos, list) else [eos] if eos is not None else []
            kw["eos_token_ids"] = tuple(dict.fromkeys([*kw["eos_token_ids"], *more]))
            kw["eos_token_id"] = kw["eos_token_id"] if kw["eos_token_id"] is not None else \
                (kw["eos_token_ids"][0] if kw["eos_token_ids"] else None)
        return cls(**kw, name=os.path.basename(os.path.normpath(path)), path=path, extra=raw)
