"""Checkpoint loading (single file and sharded) and config.json parsing."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.config import ModelConfig
from pdserve.engine.loader import load_model
from pdserve.engine.runner import ModelRunner

PROMPT = [0, 17, 300, 42, 99, 511, 3, 250, 128, 64, 7, 1, 400, 401, 402, 9, 10, 11, 12]


def _copy_config(src, dst, **overrides):
    with open(os.path.join(src, "config.json")) as f:
        raw = json.load(f)
    raw.update(overrides)
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(raw, f)
    return raw


def _write_sharded(state, out):
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: state[k].contiguous() for k in keys}, os.path.join(out, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return shards


@pytest.fixture(scope="module")
def single(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="module")
def state(model_dir):
    return load_file(os.path.join(model_dir, "model.safetensors"))


@pytest.fixture(scope="module")
def sharded_dir(model_dir, state, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sharded"))
    _copy_config(model_dir, out)
    shutil.copy(os.path.join(model_dir, "tokenizer.json"), out)
    shards = _write_sharded(state, out)
    assert all(len(k) > 1 for k in shards.values())
    # a stray file the index does not name must be ignored (it would poison every weight)
    save_file({k: torch.zeros_like(v) for k, v in state.items()}, os.path.join(out, "zz-stray.safetensors"))
    return out


def test_sharded_loads_identical_weights(single, sharded_dir, state):
    sharded = load_model(sharded_dir)
    a, b = single.state_dict(), sharded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # and those are the file's tensors (not an initialiser's)
    for k, v in state.items():
        assert torch.equal(b[k], v), k
    assert torch.equal(sharded.model.rotary_emb.inv_freq, single.model.rotary_emb.inv_freq)
    assert sharded.model.rotary_emb.inv_freq.device.type == "cpu"


def test_sharded_gives_identical_logits(model_dir, sharded_dir):
    a = ModelRunner(model_dir, num_pages=4, page_size=16, device="cpu")
    b = ModelRunner(sharded_dir, num_pages=4, page_size=16, device="cpu")
    la = a.prefill(PROMPT, [0, 1], all_logits=True)
    lb = b.prefill(PROMPT, [0, 1], all_logits=True)
    assert la.shape == (len(PROMPT), 512)
    assert torch.equal(la, lb)
    assert la.std() > 0.1  # real weights, not zeros


def test_missing_tensor_names_it(model_dir, state, tmp_path):
    _copy_config(model_dir, str(tmp_path))
    gone = "model.layers.2.mlp.up_proj.weight"
    save_file({k: v for k, v in state.items() if k != gone}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        load_model(str(tmp_path))
    assert gone in str(e.value)
    assert "1 tensors the model needs are missing" in str(e.value)


def test_missing_shard_tensor_names_it(model_dir, state, tmp_path):
    _copy_config(model_dir, str(tmp_path))
    gone = "model.norm.weight"
    _write_sharded({k: v for k, v in state.items() if k != gone}, str(tmp_path))
    with pytest.raises(ValueError, match=gone.replace(".", r"\.")):
        load_model(str(tmp_path))


def test_tied_embeddings_fill_lm_head(model_dir, state, tmp_path):
    _copy_config(model_dir, str(tmp_path), tie_word_embeddings=True)
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, str(tmp_path / "model.safetensors"))
    m = load_model(str(tmp_path))
    assert torch.equal(m.lm_head.weight, state["model.embed_tokens.weight"])


def test_no_weights_raises(model_dir, tmp_path):
    _copy_config(model_dir, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="make-model"):
        load_model(str(tmp_path))


def test_only_model_safetensors_is_read_without_an_index(model_dir, state, tmp_path):
    """As transformers: a hub repo's consolidated.safetensors beside model.safetensors is not the checkpoint."""
    _copy_config(model_dir, str(tmp_path))
    shutil.copy(os.path.join(model_dir, "model.safetensors"), tmp_path)
    save_file({"tok_embeddings.weight": torch.zeros(3, 4)}, str(tmp_path / "consolidated.safetensors"))
    m = load_model(str(tmp_path))
    assert torch.equal(m.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_model(str(tmp_path))


def test_load_in_bfloat16(model_dir, state):
    m = load_model(model_dir, dtype=torch.bfloat16)
    w = m.model.layers[0].self_attn.q_proj.weight
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, state["model.layers.0.self_attn.q_proj.weight"].to(torch.bfloat16))


@pytest.mark.parametrize("rope, kind", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 8.0}}, "'dynamic'"),
    ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "'longrope'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}, "'yarn'"),
])
def test_unimplemented_rope_raises(model_dir, tmp_path, rope, kind):
    _copy_config(model_dir, str(tmp_path), **rope)
    with pytest.raises(ValueError, match=f"rope_type {kind} is not supported"):
        ModelConfig.from_dir(str(tmp_path))
    shutil.copy(os.path.join(model_dir, "model.safetensors"), tmp_path)
    with pytest.raises(ValueError, match="rope_type"):
        load_model(str(tmp_path))


def test_scaled_rope_parameters_are_read(model_dir, tmp_path):
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    _copy_config(model_dir, str(tmp_path), rope_scaling=llama3, rope_theta=500000.0)
    cfg = ModelConfig.from_dir(str(tmp_path))
    assert cfg.rope_scaling == llama3 and cfg.rope_theta == 500000.0
    _copy_config(model_dir, str(tmp_path), rope_scaling={"type": "linear", "factor": 2.0})
    assert ModelConfig.from_dir(str(tmp_path)).rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_default_rope_accepted_and_theta_from_rope_parameters(model_dir, tmp_path):
    raw = _copy_config(model_dir, str(tmp_path), rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    del raw["rope_theta"]
    with open(tmp_path / "config.json", "w") as f:
        json.dump(raw, f)
    cfg = ModelConfig.from_dir(str(tmp_path))
    assert cfg.rope_theta == 500000.0


def test_config_fields(model_dir, tmp_path):
    cfg = ModelConfig.from_dir(model_dir)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (512, 256, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 4, 32)
    assert cfg.num_queries_per_kv == 2
    assert (cfg.bos_token_id, cfg.eos_token_id) == (0, 1)
    _copy_config(model_dir, str(tmp_path), eos_token_id=[7, 1], head_dim=64)
    cfg2 = ModelConfig.from_dir(str(tmp_path))
    assert cfg2.eos_token_id == 7 and cfg2.eos_token_ids == (7, 1) and cfg2.head_dim == 64
    # generate() stops at generation_config.json's ids too (an instruct checkpoint's end of turn)
    with open(tmp_path / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [1, 9]}, f)
    cfg3 = ModelConfig.from_dir(str(tmp_path))
    assert cfg3.eos_token_id == 7 and cfg3.eos_token_ids == (7, 1, 9)


def test_config_rejects_other_architectures_and_bad_heads(model_dir, tmp_path):
    _copy_config(model_dir, str(tmp_path), model_type="phi3", architectures=["Phi3ForCausalLM"])
    with pytest.raises(ValueError, match="phi3"):
        ModelConfig.from_dir(str(tmp_path))
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig(vocab_size=8, hidden_size=24, intermediate_size=8, num_hidden_layers=1,
                    num_attention_heads=6, num_key_value_heads=4, max_position_embeddings=8)
