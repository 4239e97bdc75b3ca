"""Pools sized in tokens or in memory: one arithmetic (sizing.py) for the runner and for a pre-deploy check."""
import argparse

import pytest

from pdserve.common.cli_args import add_engine_args, pool_size
from pdserve.engine.config import ModelConfig
from pdserve.engine.families import read_config
from pdserve.engine.kv_pool import PoolLayout
from pdserve.engine.make_model import _config
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sizing import PoolSize, PoolSizeError, kv_bytes_per_token, parse_bytes, pool_tokens_for

GiB, MiB = 2**30, 2**20


def _cfg(preset: str, arch: str = "llama") -> ModelConfig:
    return ModelConfig(**read_config(_config(arch, preset, "bfloat16")))


@pytest.mark.parametrize("text,nbytes", [("4GiB", 4 * GiB), ("512MiB", 512 * MiB), ("512mib", 512 * MiB),
                                         ("2GB", 2 * 10**9), ("1.5GiB", 3 * GiB // 2), ("1048576", 1048576),
                                         ("64 KiB", 64 * 1024), ("1TiB", 2**40)])
def test_parse_bytes(text, nbytes):
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize("text", ["4 parsecs", "GiB", "-1GiB", "", "4GiBs"])
def test_parse_bytes_refuses_what_is_not_a_size(text):
    with pytest.raises(ValueError, match="is not a size in bytes"):
        parse_bytes(text)


def test_kv_bytes_per_token_and_the_issues_pool():
    assert kv_bytes_per_token(_cfg("tiny"), "float32") == 4 * 2 * 4 * 32 * 4  # layers, K+V, kv heads, head_dim
    assert kv_bytes_per_token(_cfg("long"), "bfloat16") == 2048
    assert kv_bytes_per_token(_cfg("small"), "bfloat16") == 9 * 2 * 8 * 64 * 2
    assert kv_bytes_per_token(_cfg("tiny", "qwen3"), "float16") == 4 * 2 * 4 * 64 * 2  # Qwen3's explicit head_dim
    # the incident's fix: 4 GiB of bf16 KV of the long preset is a 2,097,152-token pool, twice its context
    assert pool_tokens_for(4 * GiB, _cfg("long"), "bfloat16", 16) == 2_097_152
    # whole pages only: 3 pages and 5 bytes hold 3 pages
    assert pool_tokens_for(3 * 16 * 2048 + 5, _cfg("long"), "bfloat16", 16) == 48


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_pool_layout_agrees_with_the_arithmetic(arch, dtype):
    cfg = _cfg("tiny", arch)
    assert PoolLayout.for_model(cfg, 16, dtype).page_nbytes == kv_bytes_per_token(cfg, dtype) * 16


def test_exactly_one_size_decides():
    with pytest.raises(ValueError, match="exactly one of tokens, memory_bytes, gpu_memory_utilization; got none"):
        PoolSize()
    with pytest.raises(ValueError, match=r"got \['tokens', 'memory_bytes'\]"):
        PoolSize(tokens=64, memory_bytes=GiB)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\], got 1.5"):
        PoolSize(gpu_memory_utilization=1.5)


def test_a_memory_budget_sizes_the_runners_pool(model_dir):
    runner = ModelRunner(model_dir, PoolSize(memory_bytes=parse_bytes("1MiB")), 16, device="cpu")
    assert runner.pool.num_tokens == MiB // 4096 and runner.pool.data_nbytes == MiB
    assert "KV pool 256 tokens (16 pages of 16, float32, 4096 bytes/token, 1.0 MiB; from --kv-cache-memory " \
           "1048576 bytes), pool/context 0.0625 of a 4096-token context" in runner.describe(4096)
    with pytest.raises(PoolSizeError, match="a KV budget of 65535 bytes, less than one page "
                                            r"\(65536 bytes: 16 tokens of 4096 bytes in float32\)"):
        ModelRunner(model_dir, PoolSize(memory_bytes=65535), 16, device="cpu")


def test_a_fraction_is_of_what_the_device_has_left_and_needs_cuda():
    fraction = PoolSize(gpu_memory_utilization=0.5)
    assert fraction.num_pages(_cfg("long"), "bfloat16", 16, free_device_bytes=GiB) == GiB // 2 // 2048 // 16
    with pytest.raises(PoolSizeError, match="--gpu-memory-utilization needs a CUDA device"):
        fraction.num_pages(_cfg("long"), "bfloat16", 16, free_device_bytes=None)


def _parse(argv):
    p = argparse.ArgumentParser()
    add_engine_args(p, "prefill", 1, 8192)
    return p.parse_args(argv)


def test_the_flags_pick_one_size(capsys):
    assert pool_size(_parse([])) == PoolSize(tokens=8192)
    assert pool_size(_parse(["--kv-cache-memory", "4GiB"])) == PoolSize(memory_bytes=4 * GiB)
    for argv, said in ((["--pool-tokens", "4096", "--kv-cache-memory", "1GiB"], "not allowed with argument"),
                       (["--kv-cache-memory", "1GiB", "--gpu-memory-utilization", "0.9"], "not allowed with argument"),
                       (["--gpu-memory-utilization", "0"], r"must be a fraction in (0, 1], got 0.0"),
                       (["--kv-cache-memory", "lots"], "'lots' is not a size in bytes")):
        with pytest.raises(SystemExit):
            _parse(argv)
        assert said in capsys.readouterr().err
    with pytest.raises(SystemExit, match="engine: --gpu-memory-utilization 0.9 needs a CUDA device, this service "
                                         "runs on cpu: size the pool with --pool-tokens or --kv-cache-memory"):
        pool_size(_parse(["--gpu-memory-utilization", "0.9", "--device", "cpu"]))
