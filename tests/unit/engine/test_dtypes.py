"""Weights keep the checkpoint's dtype, the KV pool follows them unless named, and the old --kv-dtype is an alias
of --kv-cache-dtype only; a bf16 checkpoint served in bf16 passes teacher forcing (bf16_oracle.py)."""
import argparse
import json
import logging
import os

import pytest
import torch
from safetensors import safe_open

from pdserve.common.cli_args import add_engine_args, engine_dtypes
from pdserve.engine.dtypes import DtypeError, kv_dtype, weight_dtype
from pdserve.engine.make_model import make_model
from pdserve.engine.runner import ModelRunner
from tests.oracle import OracleMismatch
from tests.unit.engine.bf16_oracle import check_bf16

PS = 16


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("long")), "long")


def checkpoint_nbytes(path: str) -> tuple[int, set[str]]:
    """The tensors' bytes and dtypes, from safetensors itself."""
    total, kinds = 0, set()
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as h:
        for k in h.keys():
            t = h.get_tensor(k)
            total, kinds = total + t.nbytes, kinds | {str(t.dtype)}
    return total, kinds


def test_weight_dtype_is_the_checkpoints_unless_named():
    assert weight_dtype("auto", "bfloat16", {"float32"}) == "bfloat16"  # config.json's word wins over the files
    assert weight_dtype("auto", None, {"float16"}) == "float16"
    assert weight_dtype("float32", "bfloat16", {"bfloat16"}) == "float32"
    with pytest.raises(DtypeError, match=r"stored in \['bfloat16', 'float32'\]: pass --dtype"):
        weight_dtype("auto", None, {"float32", "bfloat16"})
    with pytest.raises(DtypeError, match="torch_dtype 'float8_e4m3fn' is not served"):
        weight_dtype("auto", "float8_e4m3fn", {"bfloat16"})
    assert kv_dtype("auto", "bfloat16") == "bfloat16" and kv_dtype("float32", "bfloat16") == "float32"


def test_make_model_long_preset_is_bf16_at_a_million_tokens(long_dir):
    with open(os.path.join(long_dir, "config.json")) as f:
        raw = json.load(f)
    assert raw["max_position_embeddings"] == 1_048_576 and raw["torch_dtype"] == "bfloat16"
    assert raw["hidden_size"] == 256 and raw["num_hidden_layers"] == 4
    assert checkpoint_nbytes(long_dir)[1] == {"torch.bfloat16"}


def test_make_model_files_follow_the_umask(long_dir):
    """A checkpoint made as one user and served as another (the images serve as uid 10001) must be readable: every
    file is 0644 under the usual umask 022 (safetensors alone leaves its file 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    modes = {name: os.stat(os.path.join(long_dir, name)).st_mode & 0o777 for name in os.listdir(long_dir)}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}, modes


def test_bf16_checkpoint_is_served_in_bf16(long_dir):
    runner = ModelRunner(long_dir, 4, PS, device="cpu")
    nbytes, _ = checkpoint_nbytes(long_dir)
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    assert runner.weight_nbytes == nbytes == 6_328_832  # not twice that, as float32 took
    assert runner.pool.kv.dtype == torch.bfloat16 and runner.kv_dtype == "bfloat16"
    assert "weights 6328832 bytes in bfloat16" in runner.describe(1_048_576)


def test_dtype_and_kv_cache_dtype_are_separate(long_dir, model_dir):
    up = ModelRunner(long_dir, 4, PS, dtype="float32", device="cpu")
    assert {p.dtype for p in up.model.parameters()} == {torch.float32} and up.pool.kv.dtype == torch.float32
    mixed = ModelRunner(long_dir, 4, PS, kv_dtype="float32", device="cpu")
    assert {p.dtype for p in mixed.model.parameters()} == {torch.bfloat16} and mixed.pool.kv.dtype == torch.float32
    f32 = ModelRunner(model_dir, 4, PS, kv_dtype="bfloat16", device="cpu")  # the default checkpoint stays float32
    assert {p.dtype for p in f32.model.parameters()} == {torch.float32} and f32.pool.kv.dtype == torch.bfloat16
    ids = list(range(2, 40))
    assert torch.allclose(mixed.prefill(ids, [0, 1, 2]), up.prefill(ids, [0, 1, 2]), atol=1.0)


def _engine_args(argv):
    p = argparse.ArgumentParser()
    add_engine_args(p, "decode", 1, 4096)
    return p, p.parse_args(argv)


def test_kv_dtype_is_a_deprecated_alias_of_kv_cache_dtype(caplog):
    p, args = _engine_args(["--kv-dtype", "bfloat16"])
    with caplog.at_level(logging.WARNING):
        assert engine_dtypes(args) == ("auto", "bfloat16")  # the weights no longer follow it
    assert "--kv-dtype is deprecated: it is --kv-cache-dtype bfloat16" in caplog.text
    assert "DEPRECATED alias of --kv-cache-dtype" in p.format_help().replace("\n", " ").replace("  ", " ")
    caplog.clear()
    assert engine_dtypes(_engine_args([])[1]) == ("auto", "auto") and not caplog.text
    assert engine_dtypes(_engine_args(["--dtype", "float32", "--kv-cache-dtype", "float16"])[1]) == \
        ("float32", "float16")
    with pytest.raises(SystemExit):  # both spellings at once: argparse refuses, exit 2
        _engine_args(["--kv-dtype", "bfloat16", "--kv-cache-dtype", "float32"])


def _greedy(runner, prompt: list[int], n: int, pages: list[int]) -> list[int]:
    """The serving path: one prefill, then paged decode steps over scattered pages."""
    toks = [int(runner.prefill(prompt, pages)[-1].argmax())]
    for pos in range(len(prompt), len(prompt) + n - 1):
        toks.append(int(runner.decode([toks[-1]], [pos], [pages[:pos // PS + 1]])[0].argmax()))
    return toks


def test_bf16_served_tokens_pass_the_float32_reference(long_dir):
    served = ModelRunner(long_dir, 64, PS, device="cpu")
    reference = ModelRunner(long_dir, 64, PS, dtype="float32", device="cpu")
    pages = list(range(63, -1, -2)) + list(range(0, 64, 2))  # scattered, not in order
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(2, 512, (40 + 210 * seed,), generator=g).tolist()
        response = _greedy(served, prompt, 16, pages)
        assert len(set(response)) > 1
        check_bf16(reference, prompt, response)
        # the tolerance still tells foreign context apart: the same tokens after another prompt are refused
        with pytest.raises(OracleMismatch, match="bf16 tolerance"):
            check_bf16(reference, prompt[::-1], response)
