"""Prefill attention read in place from the paged pool (csrc/prefill_attention.c), both of its builds (16 lanes where
the CPU has AVX-512, 8 elsewhere): against softmax(QK^T)V computed here in float64 with an explicit causal mask over
the prefix gathered by hand, at chunk boundaries inside a page and on a page boundary, on pages scattered over the
pool with NaN in every slot the prefix does not own, the two builds giving the same floats; then through the model,
where a prompt computed in chunks must give the logits and greedy tokens of the whole prompt, both on the kernel."""
import math

import pytest
import torch

from pdserve.engine import native_prefill
from pdserve.engine.runner import Chunk, ModelRunner


def setup_module():
    assert native_prefill.why_not(torch.zeros(1, 2, 16, 4, 32), 8) is None, "make setup builds the native library"


def _reference(q, k, v, cache, pages, prefix_len):
    """Query i at position prefix_len + i sees keys 0 .. prefix_len + i: the prefix from the pool, then the chunk."""
    L, H, D = q.shape
    kvh = k.shape[1]
    ok = cache[pages, 0].reshape(-1, kvh, D)[:prefix_len].double()
    ov = cache[pages, 1].reshape(-1, kvh, D)[:prefix_len].double()
    keys = torch.cat([ok, k.double()]).repeat_interleave(H // kvh, 1)
    values = torch.cat([ov, v.double()]).repeat_interleave(H // kvh, 1)
    mask = torch.ones(L, prefix_len + L, dtype=torch.bool).tril(prefix_len)
    scores = torch.einsum("lhd,nhd->hln", q.double(), keys) * D ** -0.5
    return torch.einsum("hln,nhd->lhd", scores.masked_fill(~mask, -math.inf).softmax(-1), values)


def _case(dtype, kvh, group, D, ps, prefix_len, L, num_pages=96, layers=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = torch.full((num_pages, layers, 2, ps, kvh, D), math.nan).to(dtype)  # stale garbage everywhere
    cache = pool[:, 1]  # a layer's view: strided, as the model holds it
    pages = torch.randperm(num_pages, generator=g)[:-(-prefix_len // ps) + 1]  # scattered, one spare at the end
    for i, p in enumerate(pages.tolist()):
        n = min(ps, prefix_len - i * ps)
        if n > 0:  # only the prefix's own slots get values: the rest of its last page stays NaN
            cache[p, :, :n] = (torch.randn(2, n, kvh, D, generator=g) * 2).to(dtype)
    q = torch.randn(L, kvh * group, D, generator=g) * 2
    k = torch.randn(L, kvh, D, generator=g) * 2
    v = torch.randn(L, kvh, D, generator=g)
    return q, k, v, cache, pages


def _lanes():
    q, k, v, cache, pages = _case(torch.float32, 1, 1, 8, 16, 0, 1)
    try:
        native_prefill.prefill_attention(q, k, v, cache, pages, 0, 16)
        return [8, 16]
    except ValueError as e:
        assert "without AVX-512" in str(e)
        return [8]


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prefix_len,L", [(37, 50), (48, 3), (16, 1), (5, 140), (200, 16), (0, 33), (31, 34),
                                          (64, 65), (0, 97)])
@pytest.mark.parametrize("kvh,group,D,ps", [(4, 2, 32, 16), (2, 4, 64, 16), (1, 8, 128, 7), (3, 3, 40, 5)])
def test_matches_a_masked_softmax_over_the_gathered_prefix(lanes, dtype, prefix_len, L, kvh, group, D, ps):
    """Boundaries inside a page (37, 5), on one (48, 16), a prefix of one page, no prefix; chunk sizes around the
    kernel's 32-key tiles and its query blocks. Pool values are widened exactly: float32 arithmetic is the only
    error, whatever the dtype."""
    if lanes not in _lanes():
        pytest.skip("no AVX-512 on this CPU")
    q, k, v, cache, pages = _case(dtype, kvh, group, D, ps, prefix_len, L)
    out = native_prefill.prefill_attention(q, k, v, cache, pages, prefix_len, lanes)
    ref = _reference(q, k, v, cache, pages, prefix_len)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert not out.isnan().any()
    assert (out.double() - ref).abs().max().item() < 2e-5 * max(1.0, ref.abs().max().item())
    widest = native_prefill.prefill_attention(q, k, v, cache, pages, prefix_len)
    assert torch.equal(out, widest)  # every lane a query row, the same arithmetic in the same order at any width


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_blocks_shared_over_threads_give_the_same_attention(threads):
    """With several intra-op threads the blocks of queries of every head are shared through one counter (3 heads,
    2, 3 or 5 threads); each block is written by the one thread that took it, with the arithmetic it has alone."""
    q, k, v, cache, pages = _case(torch.float32, 3, 2, 32, 16, 700, 300, num_pages=128)
    assert 300 * (700 + 150) * 6 * 32 >= native_prefill.SPLIT_MACS  # large enough to be split
    one = native_prefill.prefill_attention(q, k, v, cache, pages, 700)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        split = native_prefill.prefill_attention(q, k, v, cache, pages, 700)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, split)
    assert (split.double() - _reference(q, k, v, cache, pages, 700)).abs().max().item() < 1e-4


def test_refuses_a_page_outside_the_pool_and_too_few_pages():
    q, k, v, cache, pages = _case(torch.float32, 4, 2, 32, 16, 40, 8)
    bad = pages.clone()
    bad[1] = cache.shape[0]
    with pytest.raises(ValueError, match="prefix page id outside the pool"):
        native_prefill.prefill_attention(q, k, v, cache, bad, 40)
    with pytest.raises(ValueError, match="fewer prefix pages than the prefix needs"):
        native_prefill.prefill_attention(q, k, v, cache, pages[:2], 40)


def test_a_pool_it_does_not_take_is_named():
    assert "head_dim 12" in native_prefill.why_not(torch.zeros(4, 2, 16, 2, 12), 4)
    assert native_prefill.why_not(torch.zeros(4, 2, 16, 2, 32, dtype=torch.float64), 4) is not None
    # the start-up line says which path runs and why
    assert native_prefill.status(torch.zeros(4, 2, 16, 2, 12), 4) == \
        "prefill attention: torch path (SDPA), a chunk's prefix gathered and masked (head_dim 12 (the kernel takes " \
        "multiples of 8 up to 256))"
    assert native_prefill.status(torch.zeros(4, 2, 16, 2, 32), 4).startswith("prefill attention: native CPU kernel")


PS = 16


@pytest.fixture(scope="module")
def runner(model_dir):
    return ModelRunner(model_dir, num_pages=128, page_size=PS, device="cpu")


@torch.inference_mode()
@pytest.mark.parametrize("cuts", [(37, 90), (48, 96), (1, 2, 130)])
def test_a_prompt_in_chunks_gives_the_whole_prompts_logits_and_tokens(runner, monkeypatch, cuts):
    """Chunk boundaries inside a page (37, 90, 1, 2, 130) and on page boundaries (48, 96), on scattered pages of a
    pool whose every other slot holds NaN; the chunked passes go through the in-place kernel (counted), and so does
    the whole prompt and each first chunk (prefix 0)."""
    calls = []
    kernel = native_prefill.prefill_attention
    monkeypatch.setattr(native_prefill, "prefill_attention", lambda *a: calls.append(a[-1]) or kernel(*a))
    n = 150
    ids = torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(sum(cuts))).tolist()
    perm = torch.randperm(runner.pool.num_pages, generator=torch.Generator().manual_seed(7)).tolist()
    whole_pages, chunk_pages = perm[:-(-n // PS)], perm[64:64 + -(-n // PS)]
    runner.pool.kv.fill_(math.nan)
    whole = runner.prefill(ids, whole_pages, all_logits=True)
    bounds = [0, *cuts, n]
    parts = [runner.prefill_batch([Chunk(ids[a:b], a, chunk_pages, True)])[0] for a, b in zip(bounds, bounds[1:])]
    chunked = torch.cat(parts)
    layers = runner.config.num_hidden_layers
    assert calls == [0] * layers + [c for c in (0, *cuts) for _ in range(layers)]  # every layer, every chunk
    assert not chunked.isnan().any()
    assert (chunked - whole).abs().max().item() < 1e-4
    assert chunked.argmax(-1).tolist() == whole.argmax(-1).tolist()
    kv = runner.pool.kv
    assert (kv[chunk_pages].nan_to_num(7.0) - kv[whole_pages].nan_to_num(7.0)).abs().max().item() < 1e-4
