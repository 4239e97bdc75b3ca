"""Which Hugging Face configs the engine serves, and how their keys map onto ModelConfig.

Fail closed: a key the engine does not know is refused by name, since an unread key that changes the math
(a bias, a rope type, an activation) would serve wrong logits without any error. Keys listed in HARMLESS
only matter for training or bookkeeping.
"""
from __future__ import annotations

from .config import CheckpointError

# model_type -> the one architecture name its checkpoints carry
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
HARMLESS = {"architectures", "model_type", "transformers_version", "_name_or_path", "torch_dtype", "dtype",
            "use_cache", "initializer_range", "attention_dropout", "pad_token_id", "output_hidden_states",
            "output_attentions", "return_dict", "id2label", "label2id", "problem_type", "chunk_size_feed_forward",
            "is_encoder_decoder", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
            # Llama's tensor-parallel split of a matmul during pre-training: the same product
            "pretraining_tp"}
COMMON = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
          "rope_parameters", "tie_word_embeddings", "bos_token_id", "eos_token_id", "head_dim", "hidden_act",
          "layer_types"}
WINDOW = {"sliding_window", "use_sliding_window", "max_window_layers"}
KEYS = {"llama": COMMON | {"attention_bias", "mlp_bias"}, "mistral": COMMON | WINDOW,
        "qwen2": COMMON | WINDOW, "qwen3": COMMON | WINDOW | {"attention_bias"},
        "qwen3_moe": COMMON | WINDOW | {"attention_bias", "num_experts", "num_local_experts", "num_experts_per_tok",
                                        "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                                        "mlp_only_layers"}}
ROPE_KEYS = {"default": set(), "linear": {"factor"},
             "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}}


def _family(raw: dict) -> str:
    archs = raw.get("architectures") or []
    mtype = raw.get("model_type")
    if mtype is None and len(archs) == 1:
        mtype = next((t for t, a in ARCHITECTURES.items() if a == archs[0]), None)
    if mtype not in ARCHITECTURES:
        raise CheckpointError(f"model_type {raw.get('model_type')!r} (architectures {archs}) is not supported; "
                              f"supported: {', '.join(ARCHITECTURES.values())}")
    if archs and archs != [ARCHITECTURES[mtype]]:
        raise CheckpointError(f"architectures {archs} is not supported for model_type {mtype!r}; "
                              f"expected [{ARCHITECTURES[mtype]!r}]")
    return mtype


def _rope(raw: dict) -> tuple[float, dict]:
    """(theta, scaling): transformers 5 writes rope_parameters, hub checkpoints rope_theta + rope_scaling."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
    rope_type = rope.pop("rope_type", "default")
    theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    if rope_type not in ROPE_KEYS:
        raise CheckpointError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_KEYS)})")
    unknown = sorted(set(rope) - ROPE_KEYS[rope_type])
    if unknown:
        raise CheckpointError(f"rope parameters {unknown} are not supported for rope_type {rope_type!r}")
    missing = sorted(ROPE_KEYS[rope_type] - set(rope))
    if missing:
        raise CheckpointError(f"rope_type {rope_type!r} needs {missing}")
    return theta, ({"rope_type": rope_type, **rope} if rope_type != "default" else {})


def _window(raw: dict, family: str) -> int:
    types = set(raw.get("layer_types") or ["full_attention"])
    if not types <= {"full_attention", "sliding_attention"}:
        raise CheckpointError(f"layer_types {sorted(types)} are not supported")
    uses = family == "mistral" or raw.get("use_sliding_window") or "sliding_attention" in types
    window = raw.get("sliding_window") if uses else None
    if uses and "sliding_attention" in types and not window:
        raise CheckpointError("layer_types has sliding_attention layers but sliding_window is not set")
    return int(window or 0)


def _experts(raw: dict) -> dict:
    n = raw.get("num_experts", raw.get("num_local_experts"))
    if "num_experts" in raw and "num_local_experts" in raw and raw["num_experts"] != raw["num_local_experts"]:
        raise CheckpointError(f"num_experts {raw['num_experts']} != num_local_experts {raw['num_local_experts']}")
    if not n:
        raise CheckpointError("a qwen3_moe checkpoint needs num_experts > 0")
    step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or [])
    layers = tuple(i for i in range(raw["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
    return dict(num_experts=n, num_experts_per_tok=raw["num_experts_per_tok"],
                moe_intermediate_size=raw["moe_intermediate_size"],
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)), moe_layers=layers)


def read_config(raw: dict) -> dict:
    """ModelConfig's keyword arguments for a config.json, or CheckpointError naming what is not served."""
    family = _family(raw)
    unknown = sorted(set(raw) - KEYS[family] - HARMLESS)
    if unknown:
        raise CheckpointError(f"{family} config keys {unknown} are not supported (the engine would ignore them)")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"hidden_act {act!r} is not supported (only 'silu')")
    theta, scaling = _rope(raw)
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ()
    attention_bias = bool(raw.get("attention_bias", False))
    kw = dict(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        max_position_embeddings=raw.get("max_position_embeddings", 2048), rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_theta=theta, rope_scaling=scaling, tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"), eos_token_id=eos_ids[0] if eos_ids else None,
        eos_token_ids=eos_ids, head_dim=raw.get("head_dim") or 0, family=family,
        # Qwen2 always has q/k/v biases and none on o_proj; Llama's and Qwen3's attention_bias covers all four
        qkv_bias=family == "qwen2" or attention_bias, o_bias=attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)), qk_norm=family in ("qwen3", "qwen3_moe"),
        sliding_window=_window(raw, family), torch_dtype=raw.get("torch_dtype") or raw.get("dtype"))
    if family == "qwen3_moe":
        kw.update(_experts(raw))
    return kw
