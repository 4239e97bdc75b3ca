"""`--model` as a Hugging Face id (issue 21, point 2): found in the local hub cache where huggingface_hub itself would
put it (its own functions are the reference here), never downloaded, and a missing one names the folder looked in."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from pdserve.common.hub import ModelNotFound, ModelRef, hub_cache_dir, is_repo_id, resolve_model

REPO = "acme-labs/Tiny-Llama.v2"
REV = "0123456789abcdef0123456789abcdef01234567"


def fill_cache(cache, repo=REPO, rev=REV, ref=True, config=True):
    """The layout `hf download` leaves: models--ORG--NAME/{refs/main, snapshots/REV/...}."""
    top = cache / ("models--" + repo.replace("/", "--"))
    snap = top / "snapshots" / rev
    snap.mkdir(parents=True)
    if config:
        (snap / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if ref:
        (top / "refs").mkdir()
        (top / "refs" / "main").write_text(rev)  # written without a newline, as huggingface_hub does
    return snap


def test_an_id_in_the_cache_is_the_snapshot_huggingface_hub_itself_finds(tmp_path, monkeypatch):
    from huggingface_hub import try_to_load_from_cache
    snap = fill_cache(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    ref = resolve_model(REPO)
    assert ref == ModelRef(REPO, str(snap), REPO)
    assert try_to_load_from_cache(REPO, "config.json", cache_dir=str(tmp_path / "hub")) == \
        os.path.join(ref.path, "config.json")
    assert ref.name == REPO  # served under the id, as vLLM serves --model as given


def test_a_local_path_wins_and_is_named_by_its_directory(tmp_path, monkeypatch):
    local = tmp_path / "acme-labs" / "Tiny-Llama.v2"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    fill_cache(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    assert resolve_model(REPO) == ModelRef(REPO, REPO)  # the relative path exists: it is the checkpoint
    assert resolve_model(REPO).name == "Tiny-Llama.v2"
    assert resolve_model(str(local / "config.json")).name == "Tiny-Llama.v2"


@pytest.mark.parametrize("env", [
    {},
    {"HF_HOME": "/srv/hf"},
    {"XDG_CACHE_HOME": "/xdg"},
    {"XDG_CACHE_HOME": "/xdg", "HF_HOME": "/srv/hf"},
    {"HF_HOME": "/srv/hf", "HUGGINGFACE_HUB_CACHE": "/legacy"},
    {"HF_HOME": "/srv/hf", "HUGGINGFACE_HUB_CACHE": "/legacy", "HF_HUB_CACHE": "/models/hub"},
    {"HF_HUB_CACHE": "~/hub"},
])
def test_the_cache_folder_follows_huggingface_hub_s_variables_in_its_order(env, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # `~` expands the same way in both processes
    base = {k: v for k, v in os.environ.items()
            if k not in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME")}
    out = subprocess.run([sys.executable, "-c", "from huggingface_hub import constants; print(constants.HF_HUB_CACHE)"],
                         env={**base, **env}, capture_output=True, text=True, timeout=60, check=True)
    assert hub_cache_dir({**base, **env}) == out.stdout.strip()


@pytest.mark.parametrize("text", ["meta-llama/Llama-3.1-8B-Instruct", "gpt2", "Qwen/Qwen2.5-0.5B", "a_b/c.d-e",
                                  "org/-name", "org/name-", "org/na--me", "org/na..me", "a/b/c", "/abs/path",
                                  "./rel", "org/" + "x" * 96, "org/" + "x" * 97, "org/na me", ""])
def test_what_counts_as_an_id_is_what_huggingface_hub_accepts(text):
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    try:
        validate_repo_id(text)
        accepted = True
    except HFValidationError:
        accepted = False
    assert is_repo_id(text) == accepted, text


def _refused(spec, **env) -> str:
    with pytest.raises(ModelNotFound) as e:
        resolve_model(spec, env)
    return str(e.value)


def test_an_id_not_in_the_cache_names_the_folder_looked_in(tmp_path):
    cache = tmp_path / "hub"
    msg = _refused(REPO, HF_HUB_CACHE=str(cache))
    assert f"the Hugging Face hub cache {cache} (HF_HUB_CACHE, else HF_HOME/hub) has no " \
           f"models--acme-labs--Tiny-Llama.v2/" in msg
    assert "never downloaded" in msg and f"HF_HUB_CACHE={cache} hf download {REPO}" in msg
    # through HF_HOME too
    assert f"cache {tmp_path / 'home' / 'hub'} " in _refused(REPO, HF_HOME=str(tmp_path / "home"))


def test_a_cache_without_refs_main_lists_the_snapshots_it_has(tmp_path):
    fill_cache(tmp_path, ref=False)
    msg = _refused(REPO, HF_HUB_CACHE=str(tmp_path))
    assert f"no {tmp_path}/models--acme-labs--Tiny-Llama.v2/refs/main (snapshots there: {REV})" in msg


def test_an_interrupted_download_is_refused_with_the_snapshot_path(tmp_path):
    snap = fill_cache(tmp_path, config=False)
    msg = _refused(REPO, HF_HUB_CACHE=str(tmp_path))
    assert f"names revision '{REV}', but {snap} has no config.json" in msg


def test_a_path_that_is_no_id_is_refused_as_a_path(tmp_path):
    assert _refused(str(tmp_path / "nothing")) == (f"--model {tmp_path / 'nothing'}: no such file or directory (and "
                                                   "not a Hugging Face id, ORG/NAME)")


def test_resolving_never_opens_a_connection(tmp_path, monkeypatch):
    def no_network(*a, **k):
        raise AssertionError("resolve_model opened a socket")
    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    assert "has no models--" in _refused(REPO, HF_HUB_CACHE=str(tmp_path))
    snap = fill_cache(tmp_path)
    assert resolve_model(REPO, {"HF_HUB_CACHE": str(tmp_path)}).path == str(snap)
