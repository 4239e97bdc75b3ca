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


def test_shards_load_one_tensor_at_a_time(model_dir, state, tmp_path, monkeypatch):
    """A bf16 sharded checkpoint served in float32: every tensor read from the files is converted, so a read
    tensor still alive is a host copy beside the weights. The old loader read every shard, then converted:
    all of them were alive at once (3x the checkpoint at the peak, counting the converted weights)."""
    import weakref

    import safetensors.torch

    from pdserve.engine import loader
    out = str(tmp_path)
    _copy_config(model_dir, out, torch_dtype="bfloat16")
    shards = _write_sharded({k: v.to(torch.bfloat16) for k, v in state.items()}, out)
    read, peak = [], [0]

    def note(t):
        peak[0] = max(peak[0], 1 + sum(r() is not None for r in read))
        read.append(weakref.ref(t))
        return t

    class Handle:
        def __init__(self, h):
            self.h = h

        def __getattr__(self, name):
            return getattr(self.h, name)

        def get_tensor(self, name):
            return note(self.h.get_tensor(name))

    class Opened:  # safe_open as a context manager whose handle counts the tensors it hands out
        def __init__(self, *a, **kw):
            self.cm = safetensors.safe_open(*a, **kw)

        def __enter__(self):
            return Handle(self.cm.__enter__())

        def __exit__(self, *exc):
            return self.cm.__exit__(*exc)

    def load_file(*a, **kw):
        return {k: note(v) for k, v in safetensors.torch.load_file(*a, **kw).items()}
    monkeypatch.setattr(loader, "safe_open", Opened, raising=False)
    monkeypatch.setattr(loader, "load_file", load_file, raising=False)
    m = load_model(out, dtype=torch.float32)
    assert len(read) == len(state) > max(len(v) for v in shards.values()) > 1  # every tensor was counted
    assert peak[0] == 1  # the old loader: 39, every tensor of both shards
    assert m.lm_head.weight.dtype == torch.float32
    assert torch.equal(m.lm_head.weight, state["lm_head.weight"].to(torch.bfloat16).float())


def test_auto_keeps_the_files_dtype_without_a_torch_dtype(model_dir, state, tmp_path):
    raw = _copy_config(model_dir, str(tmp_path))
    del raw["torch_dtype"]
    with open(tmp_path / "config.json", "w") as f:
        json.dump(raw, f)
    save_file({k: v.to(torch.float16) for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    assert load_model(str(tmp_path)).lm_head.weight.dtype == torch.float16
    save_file({k: v.to(torch.float16 if "layers.1." in k else torch.bfloat16) for k, v in state.items()},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no torch_dtype and the tensors are stored in \['bfloat16', 'float16'\]"):
        load_model(str(tmp_path))
    assert load_model(str(tmp_path), dtype="bfloat16").lm_head.weight.dtype == torch.bfloat16


def test_float8_tensors_are_refused_not_converted(model_dir, state, tmp_path):
    """float8 is a quantized checkpoint (its scales in other tensors): converting it as if it were the weight
    would serve wrong logits. The old loader converted it, since torch counts float8 as floating point."""
    _copy_config(model_dir, str(tmp_path))
    name = "model.layers.0.mlp.down_proj.weight"
    save_file({k: v.to(torch.float8_e4m3fn) if k == name else v for k, v in state.items()},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"1 tensors are not floating point .quantized checkpoints are "
                                         f"unsupported.: {name}"):
        load_model(str(tmp_path))


def test_rope_at_a_million_positions_is_transformers(tmp_path):
    """The long preset's last position rotates as transformers rotates it (the same float32 product, and the same
    rotation of q and k, bit for bit), and one step's tables are [T, 1, D] for its T tokens: nothing the size of
    the context is built."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from pdserve.engine.rope import RotaryEmbedding, apply_rope
    positions = torch.tensor([0, 1, 4095, 524_287, 1_048_574, 1_048_575])
    cos, sin = RotaryEmbedding(32, 10000.0)(positions)
    hf = LlamaRotaryEmbedding(LlamaConfig(hidden_size=256, num_attention_heads=8, max_position_embeddings=1_048_576))
    hf_cos, hf_sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    assert cos.shape == sin.shape == (len(positions), 1, 32)
    assert torch.equal(cos[:, 0], hf_cos[0])
    # ours carries the sign of rotate_half in its first half (a roll then rotates): the same numbers otherwise
    assert torch.equal(sin[:, 0], torch.cat([-hf_sin[0, :, :16], hf_sin[0, :, 16:]], dim=-1))
    q, k = torch.randn(len(positions), 8, 32), torch.randn(len(positions), 4, 32)
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    assert torch.equal(apply_rope(q, cos, sin), hf_q[0].transpose(0, 1))
    assert torch.equal(apply_rope(k, cos, sin), hf_k[0].transpose(0, 1))
