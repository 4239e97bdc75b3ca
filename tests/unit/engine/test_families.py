"""Each family, from a checkpoint transformers wrote: the engine's logits equal transformers' through prefill
and paged decode (fp32 < 1e-3; bf16 and fp16 within HALF_TOL of transformers run in the same dtype), and
checkpoints the engine does not implement are refused at load, by name."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.config import CheckpointError, ModelConfig
from pdserve.engine.loader import load_model
from pdserve.engine.runner import ModelRunner
from tests.families import FAMILIES, load_reference, write_checkpoint

PAGE = 8
PAGES = [9, 2, 14, 5, 11, 0]  # not contiguous, not in order
N, HEAD = 44, 25              # tokens in all; the prompt prefilled, the rest decoded one at a time
# bf16 keeps 8 bits of mantissa: logits (std ~1.2, |max| < 8) move by up to ~0.2 from fp32. The engine and
# transformers round at the same places except in paged decode attention (another order of sums), so between
# them the gap is a few bf16 steps at |logit| in [4, 8) (one step: 0.0625; measured: 0.0625). fp16 keeps 11
# bits (one step there: 0.0078; measured: up to 0.016). A dropped tensor or a wrong rope moves logits by units.
HALF_TOL = {"bfloat16": 0.25, "float16": 0.05}


@pytest.fixture(scope="module")
def checkpoints(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: write_checkpoint(f, str(root / f), model_dir, seed=i) for i, f in enumerate(FAMILIES)}


def _ids(seed: int) -> list[int]:
    return torch.randint(0, 512, (N,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine_logits(path: str, ids: list[int], dtype: str) -> torch.Tensor:
    """Prefill of ids[:HEAD] over scattered pages, then one decode step per remaining token: [N, V]."""
    runner = ModelRunner(path, num_pages=16, page_size=PAGE, dtype=dtype, device="cpu")
    rows = [runner.prefill(ids[:HEAD], PAGES, all_logits=True)]
    for pos in range(HEAD, N):
        rows.append(runner.decode([ids[pos]], [pos], [PAGES[: pos // PAGE + 1]]))
    return torch.cat(rows)


@torch.inference_mode()
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logits_match_transformers(checkpoints, family):
    ids = _ids(1)
    ref = load_reference(checkpoints[family])(torch.tensor([ids])).logits[0]
    ours = _engine_logits(checkpoints[family], ids, "float32")
    assert ours.shape == ref.shape == (N, 512)
    assert ref.std() > 0.5  # random weights that matter, not a near-constant output
    assert (ours - ref).abs().max().item() < 1e-3


@torch.inference_mode()
@pytest.mark.parametrize("dtype", HALF_TOL)
@pytest.mark.parametrize("family", FAMILIES)
def test_half_precision_logits_match_transformers(checkpoints, family, dtype):
    ids = _ids(2)
    ref = load_reference(checkpoints[family], getattr(torch, dtype))(torch.tensor([ids])).logits[0].float()
    ours = _engine_logits(checkpoints[family], ids, dtype)
    assert (ours - ref).abs().max().item() < HALF_TOL[dtype]


@torch.inference_mode()
def test_linear_rope_matches_transformers(model_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    from tests.families import TINY
    cfg = LlamaConfig(**TINY, rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0))
    torch.manual_seed(5)
    LlamaForCausalLM(cfg).save_pretrained(str(tmp_path))
    ids = _ids(3)
    ref = load_reference(str(tmp_path))(torch.tensor([ids])).logits[0]
    assert (_engine_logits(str(tmp_path), ids, "float32") - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_any_checkpoint_dtype_loads_into_any_dtype(checkpoints, tmp_path, dtype):
    src = checkpoints["qwen2"]
    state = load_file(os.path.join(src, "model.safetensors"))
    _copy(src, tmp_path, {k: v.to(torch.bfloat16) for k, v in state.items()})
    w = load_model(str(tmp_path), dtype=dtype).model.layers[1].self_attn.k_proj.bias
    assert w.dtype == dtype
    assert torch.equal(w, state["model.layers.1.self_attn.k_proj.bias"].to(torch.bfloat16).to(dtype))


def _copy(src, dst, state, **config):
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        raw = json.load(f)
    raw.update(config)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(raw, f)
    save_file(state, os.path.join(dst, "model.safetensors"))


def _refusal(checkpoints, tmp_path, edit=lambda s: s, family="llama", **config) -> str:
    state = edit(load_file(os.path.join(checkpoints[family], "model.safetensors")))
    _copy(checkpoints[family], tmp_path, state, **config)
    with pytest.raises(CheckpointError) as e:
        load_model(str(tmp_path))
    return str(e.value)


def test_extra_tensor_is_refused(checkpoints, tmp_path):
    """The issue's case: biases in the files, a config that says there are none."""
    msg = _refusal(checkpoints, tmp_path, attention_bias=False)
    assert "8 tensors in the checkpoint are not used by the model" in msg
    assert "model.layers.0.self_attn.k_proj.bias" in msg and "and 3 more" in msg


def test_saved_rotary_frequencies_load_only_when_the_config_gives_them(checkpoints, tmp_path):
    """Older Llama conversions carry each layer's inv_freq buffer: the config's own frequencies are dropped as
    derived, other ones (a rope the config does not state) refuse the checkpoint."""
    from pdserve.engine.rope import RotaryEmbedding
    cfg = ModelConfig.from_dir(checkpoints["llama"])
    ours = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).inv_freq
    state = load_file(os.path.join(checkpoints["llama"], "model.safetensors"))
    _copy(checkpoints["llama"], tmp_path / "same", {**state, "model.layers.0.self_attn.rotary_emb.inv_freq": ours})
    load_model(str(tmp_path / "same"))
    msg = _refusal(checkpoints, tmp_path / "other", lambda s: {
        **s, "model.layers.1.self_attn.rotary_emb.inv_freq": ours / 8})
    assert "model.layers.1.self_attn.rotary_emb.inv_freq" in msg and "a rope the config does not state" in msg


def test_missing_tensor_is_refused(checkpoints, tmp_path):
    gone = "model.layers.1.self_attn.q_norm.weight"
    msg = _refusal(checkpoints, tmp_path, lambda s: {k: v for k, v in s.items() if k != gone}, "qwen3")
    assert f"1 tensors the model needs are missing (checkpoint lacks them): {gone}" in msg


def test_expert_missing_and_wrong_shape_are_refused(checkpoints, tmp_path):
    def edit(s):
        del s["model.layers.0.mlp.experts.3.up_proj.weight"]
        s["model.layers.0.mlp.gate.weight"] = torch.zeros(5, 64)
        return s
    msg = _refusal(checkpoints, tmp_path, edit, "qwen3_moe")
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in msg
    assert "1 tensors have the wrong shape: model.layers.0.mlp.gate.weight [5, 64] (model: [4, 64])" in msg


@pytest.mark.parametrize("config, named", [
    (dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"]), "model_type 'gemma2'"),
    (dict(architectures=["LlamaForSequenceClassification"]), "LlamaForSequenceClassification"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)), "rope_type 'yarn'"),
    (dict(rope_parameters=None, rope_scaling=dict(type="dynamic", factor=2.0)), "rope_type 'dynamic'"),
    (dict(rope_parameters=dict(rope_type="llama3", rope_theta=1e4, factor=8.0)), "needs ['high_freq_factor'"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(attn_logit_softcapping=50.0), "config keys ['attn_logit_softcapping'] are not supported"),
])
def test_unsupported_config_is_refused(checkpoints, tmp_path, config, named):
    msg = _refusal(checkpoints, tmp_path, **config)
    assert named in msg and "config.json" in msg


def test_sliding_window_caps_the_context(checkpoints, tmp_path):
    state = load_file(os.path.join(checkpoints["mistral"], "model.safetensors"))
    _copy(checkpoints["mistral"], tmp_path, state, sliding_window=32)
    runner = ModelRunner(str(tmp_path), num_pages=16, page_size=PAGE, device="cpu")
    assert runner.config.max_position_embeddings == 32
    runner.prefill(_ids(4)[:32], PAGES)
    with pytest.raises(ValueError, match="position 32 is past the model's sliding_window 32"):
        runner.decode([5], [32], [PAGES[:5]])


@torch.inference_mode()
@pytest.mark.parametrize("family", FAMILIES)
def test_make_model_writes_what_transformers_reads(family, tmp_path):
    """pdserve's own writer (`pdserve make-model --arch`): transformers loads the files and agrees."""
    from pdserve import cli
    assert cli.main(["make-model", "--arch", family, "--out", str(tmp_path), "--dtype", "bfloat16"]) == 0
    ids = _ids(6)[:20]
    ref = load_reference(str(tmp_path))(torch.tensor([ids])).logits[0]
    # the bf16 weights computed in float32, as the reference computes them (served, they stay bf16)
    ours = ModelRunner(str(tmp_path), num_pages=16, page_size=PAGE, dtype="float32",
                       device="cpu").prefill(ids, PAGES[:3], True)
    assert ref.std() > 0.5 and (ours - ref).abs().max().item() < 1e-3


def test_default_make_model_is_byte_identical(tmp_path):
    """The default checkpoint's files are those the Llama-only writer produced (sha256 taken before the
    families were added): deployments and tests that made it earlier hold the same model."""
    import hashlib

    from pdserve.engine.make_model import make_model
    make_model(str(tmp_path))
    digests = {n: hashlib.sha256((tmp_path / n).read_bytes()).hexdigest()[:16]
               for n in ("config.json", "model.safetensors")}
    assert digests == {"config.json": "39f08165fa94ce12", "model.safetensors": "d0ce1345437d8a58"}
