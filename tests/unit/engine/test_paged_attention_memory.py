"""Decode attention's per-step memory follows the pages the batch reads, not the pool's size or where the pages
lie: a 1,048,576-token pool (65,536 pages of 16 tokens, a tiny KV shape so the pool itself stays small), 64
sequences of 3 pages each, on contiguous ids and on ids scattered over the whole pool. The bytes counted are
every tensor that preparing the step and one layer's attention allocate (bench/scenarios/attention_memory.py prints them,
and those of an 8B-like shape)."""
import random

import pytest
import torch

from pdserve.engine.alloc_bytes import AllocatedBytes
from pdserve.engine.paged_attention import paged_decode_attention, prepare_paged_decode

NUM_PAGES, PS, KVH, H, D, B = 65_536, 16, 2, 4, 8, 64
LENGTHS = [33 + 7 * b % 15 for b in range(B)]  # 34..47 tokens: 2 full pages and a partial last one each


@pytest.fixture(scope="module")
def cache():
    # NaN in every page the step does not read and in the read pages' slots past each sequence's length
    return torch.full((NUM_PAGES, 2, PS, KVH, D), float("nan"))


def _step(cache, pages, seed):
    tables = [pages[3 * b:3 * b + 3] for b in range(B)]
    gen = torch.Generator().manual_seed(seed)
    for t, n in zip(tables, LENGTHS):
        kv = torch.randn(2, n + 1, KVH, D, generator=gen)
        for i, page in enumerate(t):
            cache[page, :, :min(PS, n + 1 - i * PS)] = kv[:, i * PS:(i + 1) * PS]
    q = torch.randn(B, H, D, generator=gen)
    table, positions = torch.tensor(tables), torch.tensor(LENGTHS)
    with AllocatedBytes() as counted:
        pd = prepare_paged_decode(table, positions, PS, KVH, H)
        out = paged_decode_attention(q, cache, pd)
    # plain attention over each sequence's tokens, the slots past its length masked out
    kv = cache[table].permute(0, 2, 1, 3, 4, 5).reshape(B, 2, 3 * PS, KVH, D)
    seen = torch.arange(3 * PS)[None, :] <= positions[:, None]                        # [B, S]
    scores = torch.einsum("bshd,bhgd->bhgs", kv[:, 0], q.view(B, KVH, H // KVH, D)) * D ** -0.5
    w = torch.softmax(scores.masked_fill(~seen[:, None, None], float("-inf")), -1)
    ref = torch.einsum("bhgs,bshd->bhgd", w, kv[:, 1].masked_fill(~seen[:, :, None, None], 0)).reshape(B, H, D)
    worst = (out - ref).abs().amax((1, 2))
    assert worst.max().item() < 1e-5, f"sequence {worst.argmax().item()}: {worst.max().item():.2e} off"
    for t in tables:
        cache[t] = float("nan")
    return counted.bytes


def test_scattered_pages_cost_what_contiguous_pages_cost(cache):
    read = 3 * B
    contiguous = _step(cache, list(range(read)), 0)
    scattered = _step(cache, random.Random(0).sample(range(NUM_PAGES), read), 1)
    # one page's K/V copied and one float32 row of its scores against every head: what a page read costs
    per_page = 2 * PS * KVH * D * 4 + H * PS * KVH * 4
    assert scattered <= 1.5 * contiguous, f"scattered {scattered:,} bytes, contiguous {contiguous:,} bytes"
    assert max(scattered, contiguous) <= 4 * read * per_page, (
        f"scattered {scattered:,} and contiguous {contiguous:,} bytes for {read} pages read: over 4 x {per_page:,} "
        f"bytes a page")
