"""Packed prefill (several prompts in one pass, a long one in chunks) gives what one prompt at a time gives: the
same logits and the same KV in the pool (to 1e-4). The one-at-a-time path is itself checked against transformers in
test_model_parity.py."""
import pytest
import torch

from pdserve.engine.runner import Chunk, ModelRunner

PS = 16
LENGTHS = [5, 37, 130, 16, 1]


@pytest.fixture(scope="module")
def runner(model_dir):
    return ModelRunner(model_dir, num_pages=64, page_size=PS, device="cpu")


def _prompt(n, seed):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _pages(first: int, n: int) -> list[int]:
    return list(range(first, first + -(-n // PS)))


@torch.inference_mode()
def test_packed_and_chunked_prefill_equals_one_at_a_time(runner):
    prompts = [_prompt(n, 100 + n) for n in LENGTHS]
    alone_pages, packed_pages, first = [], [], 0
    for ids in prompts:  # disjoint pages: the two runs must not see each other's KV
        alone_pages.append(_pages(first, len(ids)))
        packed_pages.append(_pages(first + 20, len(ids)))
        first += len(alone_pages[-1])
    runner.pool.kv.zero_()
    alone = [runner.prefill(ids, pages, all_logits=True) for ids, pages in zip(prompts, alone_pages)]

    long = prompts[2]  # 130 tokens in three chunks, across three passes, beside whole prompts
    first_pass = runner.prefill_batch([Chunk(prompts[0], 0, packed_pages[0], True),
                                       Chunk(long[:50], 0, packed_pages[2], True),
                                       Chunk(prompts[1], 0, packed_pages[1], True)])
    second_pass = runner.prefill_batch([Chunk(long[50:99], 50, packed_pages[2], True),
                                        Chunk(prompts[3], 0, packed_pages[3], True)])
    third_pass = runner.prefill_batch([Chunk(long[99:], 99, packed_pages[2], True),
                                       Chunk(prompts[4], 0, packed_pages[4], False)])
    packed = [first_pass[0], first_pass[2], torch.cat([first_pass[1], second_pass[0], third_pass[0]]),
              second_pass[1], third_pass[1]]
    for n, a, p in zip(LENGTHS, alone, packed):
        want = a if p.shape[0] == n else a[-1:]
        assert p.shape == want.shape
        assert (p - want).abs().max().item() < 1e-4, f"prompt of {n} tokens"
    for n, a, p in zip(LENGTHS, alone_pages, packed_pages):
        # not bit for bit: a matmul over more rows may sum in another order (measured: 1e-5 on values ~3)
        assert (runner.pool.kv[a] - runner.pool.kv[p]).abs().max().item() < 1e-4, f"KV of the prompt of {n} tokens"


@torch.inference_mode()
def test_a_chunk_needs_its_pages_and_a_token(runner):
    with pytest.raises(ValueError, match="cannot hold 40 tokens"):
        runner.prefill_batch([Chunk(_prompt(8, 1), 32, [0, 1], False)])
    with pytest.raises(ValueError, match="at least one token"):
        runner.prefill_batch([Chunk([], 0, [0], False)])
