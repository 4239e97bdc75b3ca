"""The GPU overlay checks each prefill and decode pod's flags before its service starts (issue 19, point 5): an init
container runs `pdserve check` with exactly the service container's command line and the broker's lock_delay, and
the flags the overlay passes are what a real checkpoint needs (a Llama 3.1 8B config.json: 131,072 positions). The
checkpoint is named by its Hugging Face id in the hub cache on the claim (issue 21, point 2): the check finds it
there, as the service would, with the pod's own environment, and a claim without it is refused naming the cache."""
from __future__ import annotations

import json

import pytest

from pdserve import cli
from tests.deploy.render import by_kind, containers, flag, render, workloads

# Llama 3.1 8B's config.json as the hub ships it: a real checkpoint's context is over every CPU default pool
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 128, "hidden_act": "silu",
            "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
            "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
            "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
            "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
            "vocab_size": 128256}


MODEL = "meta-llama/Llama-3.1-8B-Instruct"
REV = "0e9e39f249a16976918f6564b8830bc894c89659"


def _pod(role: str) -> tuple[list[str], list[str]]:
    spec = by_kind(render("gpu"), "Deployment")[f"pdserve-{role}"]
    [init] = containers(spec, init=True)
    return init["args"], containers(spec)[0]["args"]


def _env(role: str) -> dict[str, str]:
    [init] = containers(by_kind(render("gpu"), "Deployment")[f"pdserve-{role}"], init=True)
    return {e["name"]: e["value"] for e in init["env"] if "value" in e}


def _claim_with(tmp_path, monkeypatch, role: str, config: dict | None):
    """The claim's /models on this machine, holding the model in the hub cache the pod's env names (or nothing)."""
    cache = _env(role)["HF_HUB_CACHE"]
    assert cache.startswith("/models/")
    local = tmp_path / cache.removeprefix("/models/")
    if config is not None:
        snap = local / ("models--" + MODEL.replace("/", "--")) / "snapshots" / REV
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps(config))
        (snap.parent.parent / "refs").mkdir()
        (snap.parent.parent / "refs" / "main").write_text(REV)
    monkeypatch.setenv("HF_HUB_CACHE", str(local))
    return local


def test_every_pod_serves_one_model_by_its_id_from_the_claim_s_hub_cache():
    for w in workloads(render("gpu")):
        name = w["metadata"]["name"]
        if name == "pdserve-broker":
            continue
        mounts = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        assert mounts["models"]["persistentVolumeClaim"] == {"claimName": "pdserve-models", "readOnly": True}, name
        for c in containers(w) + containers(w, init=True):
            assert flag(c["args"], "--model") == MODEL, (name, c["name"])
            assert {"name": "HF_HUB_CACHE", "value": "/models/hub"} in c["env"], (name, c["name"])
            assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"], (name, c["name"])
            if name != "pdserve-gateway":
                assert flag(c["args"], "--device") == "cuda", (name, c["name"])
    gw = containers(by_kind(render("gpu"), "Deployment")["pdserve-gateway"])[0]["args"]
    names = gw[gw.index("--served-model-name") + 1:]
    assert names[:2] == [MODEL, "llama-3.1-8b-instruct"]


def _broker_lock_delay() -> float:
    args = containers(by_kind(render("gpu"), "Deployment")["pdserve-broker"])[0]["args"]
    return cli.build_parser(args).parse_args(args).lock_delay


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_init_container_checks_the_service_containers_own_flags(role):
    init, main = _pod(role)
    assert init[:3] == ["check", "--lock-delay", init[2]] and init[3:] == main
    assert float(init[2]) == _broker_lock_delay()
    assert main[main.index("--context-length") + 1] == "32768" and main[main.index("--pool-tokens") + 1] == "65536"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_its_flags_pass_for_a_real_checkpoint_and_the_defaults_would_not(role, tmp_path, monkeypatch, capsys):
    _claim_with(tmp_path, monkeypatch, role, LLAMA_8B)
    argv, _ = _pod(role)
    assert cli.main(argv) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "  KV per token:  131072 bytes (32 layers x 2 x 8 KV heads x 128 x 2 bytes of bfloat16)" in out
    assert "  context:       32768 tokens; pool/context 2.000" in out
    # without the overlay's context and pool flags the service would refuse the checkpoint's 131,072 positions
    bare = argv[:argv.index("--context-length")]
    assert cli.main(bare) == 1
    assert "refusing to start" in capsys.readouterr().out


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_claim_without_the_model_fails_the_check_naming_the_cache(role, tmp_path, monkeypatch, capsys):
    cache = _claim_with(tmp_path, monkeypatch, role, None)
    argv, _ = _pod(role)
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert f"  exits with:    pdserve {role}: --model {MODEL}: no local directory" in out
    assert f"the Hugging Face hub cache {cache} (HF_HUB_CACHE, else HF_HOME/hub) has no " \
           "models--meta-llama--Llama-3.1-8B-Instruct/" in out
