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
from .model import LlamaForCausalLM

PRESETS = {
    # a few million parameters: the embedded default, fast on two CPU cores
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, max_position_embeddings=4096),
    # ~107M parameters: for benchmarks
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=9, num_attention_heads=16,
                  num_key_value_heads=8, max_position_embeddings=4096),
}
VOCAB_SIZE = 512
BOS, EOS = "<s>", "</s>"

# Training text for the byte-level BPE tokenizer, so generated ids decode to word pieces.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A disaggregated server runs prefill and decode on
separate machines and moves the key value cache between them. Every page has an owner, an epoch and
a generation; a page whose tag does not match its lease is never read. Hello world, hello there,
how are you today? The weather is fine and the river runs to the sea. Numbers one two three four
five six seven eight nine ten. Once upon a time there was a small model that answered questions
about the stars, the moon and the long road home. Requests arrive, wait in a queue, and leave with
their answers; nothing is lost and nothing is shared between users.
"""


def _train_tokenizer(out: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    tok.save(os.path.join(out, "tokenizer.json"))


def make_model(out: str, preset: str = "tiny", seed: int = 0) -> str:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    os.makedirs(out, exist_ok=True)
    _train_tokenizer(out)
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
