"""The engine's logits match transformers' LlamaForCausalLM on the same files (fp32, < 1e-3), over each of its
decode paths: the whole step in one native call (the CPU's, at any batch size), the native attention block, the
native attention alone, and the torch path (what a GPU runs)."""
import random

import pytest
import torch

from pdserve.engine.runner import ModelRunner

LENGTHS = [1, 2, 15, 16, 17, 31, 33, 64, 100, 255, 300]


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


DECODE_PATHS = ["step", "block", "attention", "torch"]


def use_path(runner: ModelRunner, path: str) -> ModelRunner:
    """Forces one decode path (the runner picks the fastest it has otherwise)."""
    if path != "step":
        runner.native_step = None
    runner.native_block = path in ("step", "block")
    runner.native_decode = path != "torch"
    return runner


@pytest.fixture(scope="module", params=DECODE_PATHS)
def runner(model_dir, request):
    r = ModelRunner(model_dir, num_pages=128, page_size=16, device="cpu")
    assert r.native_step is not None and r.native_block and r.native_decode  # the CPU default: all of them
    return use_path(r, request.param)


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=g).tolist()


@torch.inference_mode()
@pytest.mark.parametrize("n", LENGTHS)
def test_prefill_logits_match_transformers(hf, runner, n):
    ids = _prompt(n, n)
    ours = runner.prefill(ids, list(range(-(-n // 16))), all_logits=True)
    ref = hf(torch.tensor([ids])).logits[0]
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-3


@torch.inference_mode()
@pytest.mark.parametrize("n", [1, 16, 17, 300])
def test_paged_decode_logits_match_transformers(hf, runner, n):
    """Prefill half the prompt into scattered pages, then decode the rest token by token."""
    ids = _prompt(n + 20, 1000 + n)
    pages = random.Random(n).sample(range(128), -(-(n + 20) // 16))
    ref = hf(torch.tensor([ids])).logits[0]
    head = max(1, n // 2)
    runner.prefill(ids[:head], pages)
    worst = 0.0
    for pos in range(head, len(ids)):
        logits = runner.decode([ids[pos]], [pos], [pages[: pos // 16 + 1]])
        worst = max(worst, (logits[0] - ref[pos]).abs().max().item())
    assert worst < 1e-3


@torch.inference_mode()
def test_batched_decode_equals_single(runner):
    """Sequences of different lengths decoded in one batch give the logits each gives alone."""
    seqs = [_prompt(n, 7 * n) for n in (5, 40, 77)]
    tables = [[0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25, 26]]
    for s, t in zip(seqs, tables):
        runner.prefill(s[:-1], t)
    batch = runner.decode([s[-1] for s in seqs], [len(s) - 1 for s in seqs], tables)
    for b, (s, t) in enumerate(zip(seqs, tables)):
        alone = runner.prefill(s, t, all_logits=False)[0]
        assert (batch[b] - alone).abs().max().item() < 1e-4


@torch.inference_mode()
def test_garbage_in_masked_slots_does_not_change_decode(runner):
    """Slots past a sequence's length (stale bytes, or page 0 used as padding) must not leak into its
    logits, even when they hold values that overflow (a freed page's canary, or a stale inf)."""
    seq = _prompt(21, 5)
    pages = [30, 31]
    runner.prefill(seq[:-1], pages)
    clean = runner.decode([seq[-1]], [20], [pages])[0].clone()
    runner.prefill(seq[:-1], pages)
    runner.pool.kv[31, :, :, 5:] = float("inf")  # beyond position 20, never attended
    runner.pool.kv[0] = float("nan")              # the padding page of the shorter sequence below
    other = _prompt(40, 6)
    runner.prefill(other[:-1], [40, 41, 42])
    batch = runner.decode([seq[-1], other[-1]], [20, 39], [pages, [40, 41, 42]])
    assert torch.isfinite(batch).all()
    assert (batch[0] - clean).abs().max().item() < 1e-4
    runner.pool.kv[0] = 0


@torch.inference_mode()
def test_mixed_lengths_over_stale_pages_equal_prefill(runner):
    """A 1-token and a 1000-token context and others in one step, over shuffled pages with a gap of 19 unused
    ids (two runs of pages, each with ids nobody in the batch reads), two not-yet-reached pages past each
    table's end, and NaN or inf in every page and slot the step must not read: each sequence's logits equal a
    full prefill of it alone."""
    lengths = [1, 2, 1000, 17, 32, 300]
    ids = list(range(1, 41)) + list(range(60, 128))
    random.Random(3).shuffle(ids)
    tables = []
    for n in lengths:
        tables.append(ids[:-(-n // 16) + 2])
        ids = ids[len(tables[-1]):]
    seqs = [_prompt(n, 2000 + n) for n in lengths]
    runner.pool.kv[:64] = float("nan")
    runner.pool.kv[64:] = float("inf")
    alone = [runner.prefill(s, t)[0] for s, t in zip(seqs, tables)]  # also writes the contexts' K/V
    for n, t in zip(lengths, tables):
        runner.pool.kv[t[(n - 1) // 16], :, :, (n - 1) % 16] = float("nan")  # the step must write its own
    batch = runner.decode([s[-1] for s in seqs], [n - 1 for n in lengths], tables)
    runner.pool.kv.zero_()
    assert torch.isfinite(batch).all()
    for b, ref in enumerate(alone):
        assert (batch[b] - ref).abs().max().item() < 1e-4, f"sequence {b} ({lengths[b]} tokens)"


@torch.inference_mode()
def test_the_native_step_gives_a_sequence_the_same_logits_whatever_shares_its_step(model_dir):
    """Bit for bit: each output of the native step is one dot product in a fixed order, whatever the batch."""
    runner = ModelRunner(model_dir, num_pages=128, page_size=16, device="cpu")
    seqs = [_prompt(n, 3 * n) for n in (9, 50, 120, 33)]
    tables = [list(range(10 * b, 10 * b + 9)) for b in range(4)]
    for s, t in zip(seqs, tables):
        runner.prefill(s[:-1], t)
    batch = runner.decode([s[-1] for s in seqs], [len(s) - 1 for s in seqs], tables)
    for b, (s, t) in enumerate(zip(seqs, tables)):
        alone = runner.decode([s[-1]], [len(s) - 1], [t])
        assert torch.equal(batch[b], alone[0])


def _decode_steps(runner: ModelRunner, lengths: list[int], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefills one prompt per length (pages 10 apart), then decodes `steps` greedy tokens for all of them in one
    batch per step; returns each sequence's tokens and each step's logits."""
    runner.pool.kv.zero_()
    tables = [list(range(10 * b, 10 * b + 10)) for b in range(len(lengths))]
    seqs = [_prompt(n, 11 * n + b) for b, n in enumerate(lengths)]
    for s, t in zip(seqs, tables):
        runner.prefill(s[:-1], t)
    out, logits = [[] for _ in seqs], []
    last = [s[-1] for s in seqs]
    pos = [len(s) - 1 for s in seqs]
    for _ in range(steps):
        step = runner.decode(last, pos, tables)
        logits.append(step)
        last = step.argmax(-1).tolist()
        for b, tok in enumerate(last):
            out[b].append(tok)
        pos = [p + 1 for p in pos]
    return out, logits


@torch.inference_mode()
@pytest.mark.parametrize("batch", [9, 16, 33])
def test_the_native_step_above_eight_sequences_matches_the_torch_path(model_dir, batch):
    """Batches past one GEMM tile of rows run the native step, and give the torch path's greedy tokens (float32)."""
    lengths = [2 + (37 * b) % 140 for b in range(batch)]
    native_runner = ModelRunner(model_dir, num_pages=10 * batch, page_size=16, device="cpu")
    torch_runner = use_path(ModelRunner(model_dir, num_pages=10 * batch, page_size=16, device="cpu"), "torch")
    assert native_runner.native_step is not None and torch_runner.native_step is None
    ours, ours_logits = _decode_steps(native_runner, lengths, 6)
    ref, ref_logits = _decode_steps(torch_runner, lengths, 6)
    assert ours == ref
    assert max((a - b).abs().max().item() for a, b in zip(ours_logits, ref_logits)) < 1e-4


@torch.inference_mode()
@pytest.mark.parametrize("batch", [9, 16, 33])
def test_a_large_native_step_gives_each_sequence_its_logits_alone(model_dir, batch):
    """Bit for bit at batch sizes that split into several tiles of rows (and leave a partial one): a sequence's logits
    do not depend on which tile of the step it lands in."""
    runner = ModelRunner(model_dir, num_pages=10 * batch, page_size=16, device="cpu")
    lengths = [2 + (53 * b) % 150 for b in range(batch)]
    tables = [list(range(10 * b, 10 * b + 10)) for b in range(batch)]
    seqs = [_prompt(n, 5 * n + b) for b, n in enumerate(lengths)]
    for s, t in zip(seqs, tables):
        runner.prefill(s[:-1], t)
    step = runner.decode([s[-1] for s in seqs], [len(s) - 1 for s in seqs], tables)
    for b in (0, batch // 2, batch - 1):
        alone = runner.decode([seqs[b][-1]], [len(seqs[b]) - 1], [tables[b]])
        assert torch.equal(step[b], alone[0]), f"sequence {b} of {batch}"
