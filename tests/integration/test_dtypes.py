"""The long-context preset (a 1,048,576-token context, bf16) served by the whole stack in bf16 with small pools:
the services hold the checkpoint's bytes, not twice them, and every streamed token passes teacher forcing
against a float32 reference of the same bf16 weights (tolerance stated in tests/unit/engine/bf16_oracle.py)."""
import re
import subprocess
import sys

import pytest
import torch

from pdserve.engine.make_model import make_model
from pdserve.engine.runner import ModelRunner
from tests.integration.stack import Stack
from tests.unit.engine.bf16_oracle import check_bf16
from tests.unit.engine.test_dtypes import checkpoint_nbytes

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("long")), "long")


@pytest.fixture(scope="module")
def stack(long_dir):
    # decode's pool by memory, through the deprecated spelling of its dtype: both must reach the pool
    s = Stack(long_dir, prefill_pool_tokens=2048, decode_pool_tokens=0, allow_small=True,
              extra={"decode": ["--kv-cache-memory", "8MiB", "--kv-dtype", "bfloat16"]})
    yield s
    s.close()


def _lines(stack, service: str) -> str:
    return "".join(stack.procs[service][0].lines)


def test_the_services_hold_the_checkpoints_bf16_bytes(stack, long_dir):
    nbytes, kinds = checkpoint_nbytes(long_dir)
    assert kinds == {"torch.bfloat16"}
    for service, tokens, source in (("prefill", 2048, "--pool-tokens 2048"),
                                    ("decode", 4096, "--kv-cache-memory 8388608 bytes")):
        log = _lines(stack, service)
        weights = re.search(r"weights (\d+) bytes in (\w+)", log)
        assert weights and (int(weights.group(1)), weights.group(2)) == (nbytes, "bfloat16"), log[-3000:]
        assert (f"KV pool {tokens} tokens ({tokens // 16} pages of 16, bfloat16, 2048 bytes/token, "
                f"{tokens * 2048 / 2**20:.1f} MiB; from {source}), pool/context {tokens / 1_048_576:.4g} of a "
                f"1048576-token context") in log
    assert "--kv-dtype is deprecated: it is --kv-cache-dtype bfloat16" in _lines(stack, "decode")
    assert "lands within" in _lines(stack, "prefill")  # the landing bound, beside the pool line


def test_streamed_bf16_tokens_pass_the_float32_reference(stack, long_dir):
    reference = ModelRunner(long_dir, 64, 16, dtype="float32", device="cpu")
    for seed, n in ((0, 37), (1, 300)):  # 300: prompt pages that are full and one that is not
        prompt = torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
        out = stack.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert "error" not in out, out
        assert len(out["token_ids"]) == MAX_TOKENS and len(set(out["token_ids"])) > 1
        check_bf16(reference, prompt, out["token_ids"], "float32 reference of the bf16 weights")


def _decode_refusal(long_dir, *flags) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", "decode", "--model", long_dir, "--port", "0",
                           "--metrics-port", "0", "--broker", "127.0.0.1:1", "--insecure", "--allow-unsafe",
                           "insecure", "--device", "cpu", *flags], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("flags,said", [
    (["--gpu-memory-utilization", "0.9"], "decode: --gpu-memory-utilization 0.9 needs a CUDA device, this service "
                                          "runs on cpu: size the pool with --pool-tokens or --kv-cache-memory"),
    (["--kv-cache-memory", "1KiB"], "decode: refusing to start: --kv-cache-memory 1024 bytes gives a KV budget of "
                                    "1024 bytes, less than one page (32768 bytes: 16 tokens of 2048 bytes in "
                                    "bfloat16)"),
])
def test_a_pool_size_that_cannot_be_served_ends_with_one_line(long_dir, flags, said):
    run = _decode_refusal(long_dir, *flags)
    assert run.returncode != 0 and said in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr + run.stdout
