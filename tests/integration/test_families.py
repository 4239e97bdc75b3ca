"""Each family served by the whole disaggregated stack from a checkpoint transformers wrote: greedy tokens
streamed through the gateway are, one by one, the argmax of transformers' logits given the prompt and the
tokens before them (teacher forcing), so prefill, the KV transfer and paged decode are checked per family."""
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.families import FAMILIES, load_reference, write_checkpoint
from tests.integration.stack import Stack

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def stacks(tmp_path_factory, model_dir):
    """One small stack per family, started and stopped side by side: most of a start or a stop is waiting
    (a process importing, a drain), so five at once take little longer than one."""
    root = tmp_path_factory.mktemp("families")
    paths = {f: write_checkpoint(f, str(root / f), model_dir, seed=10) for f in FAMILIES}

    def start(path):
        return Stack(path, context_length=512, prefill_pool_tokens=512, decode_pool_tokens=1024)

    with ThreadPoolExecutor(len(paths)) as pool:
        futures = {f: pool.submit(start, p) for f, p in paths.items()}
        started = {}
        try:
            for f, fut in futures.items():
                started[f] = fut.result()
            yield {f: (paths[f], s) for f, s in started.items()}
        finally:
            for fut in futures.values():  # a stack that started after another failed is stopped too
                if fut.exception() is None:
                    pool.submit(fut.result().close)


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_greedy_tokens_are_transformers_argmax(family, stacks):
    path, stack = stacks[family]
    prompt = torch.randint(2, 512, (37,), generator=torch.Generator().manual_seed(len(family))).tolist()
    out = stack.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert "error" not in out, out
    generated = out["token_ids"]
    assert len(generated) == MAX_TOKENS and out["prompt_tokens"] == len(prompt)
    with torch.inference_mode():
        logits = load_reference(path)(torch.tensor([prompt + generated])).logits[0]
    # the row before each generated token is what predicts it
    expected = logits[len(prompt) - 1:-1].argmax(-1).tolist()
    assert generated == expected
    assert len(set(generated)) > 1  # not a constant stream that any broken model could produce


def test_a_service_refuses_a_checkpoint_it_would_serve_wrongly(tmp_path, model_dir):
    """The issue's case: transformers wrote Llama attention biases, config.json says there are none. Decode
    exits 2 with the tensors named, before it registers anything, and without a traceback."""
    path = write_checkpoint("llama", str(tmp_path / "biased"), model_dir)
    with open(f"{path}/config.json") as f:
        raw = json.load(f)
    with open(f"{path}/config.json", "w") as f:
        json.dump({**raw, "attention_bias": False}, f)
    run = subprocess.run([sys.executable, "-m", "pdserve.cli", "decode", "--model", path, "--port", "0",
                          "--metrics-port", "0", "--broker", "127.0.0.1:1", "--insecure", "--allow-unsafe", "insecure"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "8 tensors in the checkpoint are not used by the model" in run.stderr
    assert "model.layers.0.self_attn.q_proj.bias" in run.stderr
    assert "Traceback" not in run.stderr + run.stdout
