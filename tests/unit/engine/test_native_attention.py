"""The native CPU decode attention (csrc/paged_attention.c) against attention computed independently in float64
from the pages gathered by hand, over pool dtypes, head sizes and groups (specialised and generic code paths);
its refusals of tables that point outside the pool; and that loading it leaves the process's float state alone."""
import pytest
import torch

from pdserve.engine import native


def setup_module():
    assert native._load() is not None, native.status()  # make setup builds it; CI must run it


def _reference(q, cache, table, lens):
    """softmax(q k / sqrt(D)) v over each sequence's first lens[b] slots, in float64."""
    B, H, D = q.shape
    kvh = cache.shape[3]
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        pages = table[b, :-(-n // cache.shape[2])]
        k = cache[pages, 0].reshape(-1, kvh, D)[:n].double().repeat_interleave(H // kvh, 1)
        v = cache[pages, 1].reshape(-1, kvh, D)[:n].double().repeat_interleave(H // kvh, 1)
        w = (torch.einsum("hd,nhd->hn", q[b].double(), k) * D ** -0.5).softmax(-1)
        out[b] = torch.einsum("hn,nhd->hd", w, v)
    return out


def _case(dtype, kvh, group, D, ps=16, layers=3, layer=1, num_pages=160, lens=(1, 15, 16, 17, 200, 333), seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = (torch.randn(num_pages, layers, 2, ps, kvh, D, generator=g) * 2).to(dtype)
    cache = pool[:, layer]  # a layer's view: strided, not contiguous, as the model hands it over
    lens = torch.tensor(lens, dtype=torch.int64)
    P = max(-(-int(n) // ps) for n in lens) + 2
    # pages scattered over the pool, each sequence its own, padding past its pages never read
    table = torch.randperm(num_pages, generator=g)[:len(lens) * P].view(len(lens), P).contiguous()
    q = torch.randn(len(lens), kvh * group, D, generator=g) * 2
    return q, cache, table, lens


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-5), (torch.float16, 2e-5)])
@pytest.mark.parametrize("kvh,group,D", [(4, 2, 32), (2, 4, 64), (1, 8, 128), (8, 1, 32), (3, 3, 48), (2, 5, 16)])
def test_matches_float64_attention_over_the_same_pages(dtype, tol, kvh, group, D):
    """Pool dtypes are read as stored and widened exactly (bf16 and f16 are exact in float32), so the only error is
    float32 arithmetic: the tolerance does not depend on the dtype."""
    q, cache, table, lens = _case(dtype, kvh, group, D)
    out = native.paged_decode_attention(q, cache, table, lens)
    ref = _reference(q, cache, table, lens)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert (out.double() - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())


def test_shared_pages_and_a_page_size_of_one():
    """Sequences that read the same leading pages (a cached prefix) get their own attention each; page size 1."""
    q, cache, table, lens = _case(torch.float32, 4, 2, 32, ps=1, num_pages=300, lens=(40, 77, 77))
    table[1:, :40] = table[0, :40]
    out = native.paged_decode_attention(q, cache, table, lens)
    assert (out.double() - _reference(q, cache, table, lens)).abs().max().item() < 1e-4


def test_extreme_scores_stay_finite_and_exact():
    """A key far larger than the others (scores of thousands) takes all the weight; large negative ones none."""
    q, cache, table, lens = _case(torch.float32, 2, 2, 32, lens=(50,))
    cache[table[0, 1], 0, 3] = q[0, 0].view(1, 32) * 60  # one slot with a huge score for head 0 (kv head 0)
    out = native.paged_decode_attention(q, cache, table, lens)
    ref = _reference(q, cache, table, lens)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max().item() < 1e-4
    assert torch.allclose(out[0, 0], cache[table[0, 1], 1, 3, 0], atol=1e-5)


@pytest.mark.parametrize("bad,why", [("page", "outside the pool"), ("negative", "outside the pool"),
                                     ("long", "longer than its page table"), ("empty", "or empty")])
def test_a_table_outside_the_pool_is_refused_before_any_read(bad, why):
    q, cache, table, lens = _case(torch.float32, 4, 2, 32, lens=(20, 40))
    if bad == "page":
        table[1, 2] = cache.shape[0]       # one past the last page, in the part of the table sequence 1 reads
    elif bad == "negative":
        table[0, 1] = -1
    elif bad == "long":
        lens[1] = table.shape[1] * 16 + 1  # more tokens than its table has pages for
    else:
        lens[0] = 0
    with pytest.raises(ValueError, match=why):
        native.paged_decode_attention(q, cache, table, lens)


def test_padding_past_a_sequence_is_never_read():
    """Table entries past a sequence's pages may hold anything (the runner pads with 0): garbage ids there are
    not refused, because they are not read."""
    q, cache, table, lens = _case(torch.float32, 4, 2, 32, lens=(20, 40))
    table[0, 2:] = 10**9
    out = native.paged_decode_attention(q, cache, table, lens)
    assert (out.double() - _reference(q, cache, table, lens)).abs().max().item() < 1e-4


def test_loading_leaves_subnormals_alone():
    """A library linked with -ffast-math sets flush-to-zero for the whole process when it loads, which changes
    what torch computes elsewhere: the build compiles with it and links without it."""
    native._load()
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert (tiny * 1.0).item() != 0.0


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_the_block_writes_the_rotated_k_and_v_into_each_sequences_slot_then_attends(pool_dtype):
    """decode_attention_block against the same steps done with torch: rope (rope.py) on q and k, k and v stored in
    slot lens[b] - 1 of the sequence's own pages (rounded to the pool's dtype as torch rounds), attention over the
    pages; nothing else in the pool changes."""
    from pdserve.engine.rope import RotaryEmbedding, apply_rope

    kvh, group, D = 2, 4, 64
    H = kvh * group
    _, cache, table, lens = _case(pool_dtype, kvh, group, D, lens=(1, 16, 17, 200))
    B = len(lens)
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(B, (H + 2 * kvh) * D + 7, generator=g)[:, :(H + 2 * kvh) * D]  # strided rows, as a view
    cos, sin = RotaryEmbedding(D, 10000.0)(lens - 1)
    before = cache.clone()
    out = native.decode_attention_block(qkv, cos[:, 0], sin[:, 0], cache, table, lens, H)

    q = apply_rope(qkv[:, :H * D].view(B, H, D), cos, sin)
    k = apply_rope(qkv[:, H * D:(H + kvh) * D].view(B, kvh, D), cos, sin)
    v = qkv[:, (H + kvh) * D:].reshape(B, kvh, D)
    pages = table[torch.arange(B), (lens - 1) // 16]
    expect = before.clone()
    expect[pages, 0, (lens - 1) % 16] = k.to(pool_dtype)
    expect[pages, 1, (lens - 1) % 16] = v.to(pool_dtype)
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))  # bit for bit, and nowhere else
    ref = _reference(q, cache, table, lens)
    assert (out.double() - ref).abs().max().item() < 2e-5 * max(1.0, ref.abs().max().item())


def test_the_block_refuses_a_slot_outside_the_pool_and_writes_nothing():
    q, cache, table, lens = _case(torch.float32, 2, 2, 32, lens=(20, 40))
    table[1, 2] = cache.shape[0]  # the page sequence 1's new token would be written into
    qkv = torch.randn(2, (4 + 4) * 32)
    before = cache.clone()
    cos, sin = torch.ones(2, 32), torch.zeros(2, 32)
    with pytest.raises(ValueError, match="outside the pool"):
        native.decode_attention_block(qkv, cos, sin, cache, table, lens, 4)
    assert torch.equal(cache, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kvh,group,D", [(4, 2, 32), (1, 8, 128), (8, 1, 64)])
@pytest.mark.parametrize("ps", [3, 12, 24])
def test_page_sizes_that_are_not_a_multiple_of_eight(dtype, kvh, group, D, ps):
    """The vectorised sizes reduce eight tokens' scores at a time: pages that end part-way through an eight, at
    lengths that end part-way through a page, give float64's attention."""
    q, cache, table, lens = _case(dtype, kvh, group, D, ps=ps, num_pages=400, lens=(1, ps - 1, ps + 1, 5 * ps + 7))
    out = native.paged_decode_attention(q, cache, table, lens)
    ref = _reference(q, cache, table, lens)
    assert (out.double() - ref).abs().max().item() < 2e-5 * max(1.0, ref.abs().max().item())


def test_a_sequence_gets_the_same_bits_alone_in_a_batch_and_on_other_pages():
    """Its output depends on its query and its pages' contents only: not on the sequences beside it, nor on where
    in the pool its pages lie (the kernel asks for pages ahead of the one it reads)."""
    q, cache, table, lens = _case(torch.float32, 4, 2, 32, num_pages=200, lens=(333, 17, 200))
    batch = native.paged_decode_attention(q, cache, table, lens)
    alone = native.paged_decode_attention(q[:1], cache, table[:1], lens[:1])
    assert torch.equal(batch[0], alone[0])
    pages = table[0, :-(-333 // 16)]
    moved = torch.arange(100, 100 + len(pages))  # the same contents, adjacent pages elsewhere in the pool
    other = cache.clone()
    other[moved] = cache[pages]
    table2 = table[:1].clone()
    table2[0, :len(pages)] = moved
    assert torch.equal(native.paged_decode_attention(q[:1], other, table2, lens[:1])[0], alone[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_every_specialised_size_against_float64(dtype, D, group):
    """Each compiled size (head_dim 32/64/128, group 1/2/4/8, each pool dtype) on pages drawn out of order, the
    pool's last page among them, lengths that end part-way through a page and through an eight."""
    kvh = 2 if group < 8 else 1
    q, cache, table, lens = _case(dtype, kvh, group, D, num_pages=64, lens=(1, 9, 16, 45, 130), seed=D + group)
    for (b, p), page in (((4, 3), cache.shape[0] - 1), ((3, 0), cache.shape[0] - 2)):  # the pool's last pages
        table[table == page] = table[b, p].item()  # a swap: still one sequence per page
        table[b, p] = page
    out = native.paged_decode_attention(q, cache, table, lens)
    ref = _reference(q, cache, table, lens)
    assert (out.double() - ref).abs().max().item() < 2e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ps", [64, 72, 256])
def test_pages_longer_than_a_segment(dtype, ps):
    """A page of more than 64 tokens is attended in several passes of at most 64, the last of them partial."""
    q, cache, table, lens = _case(dtype, 4, 2, 32, ps=ps, num_pages=40, lens=(1, ps - 1, ps + 65, 3 * ps + 70))
    out = native.paged_decode_attention(q, cache, table, lens)
    ref = _reference(q, cache, table, lens)
    assert (out.double() - ref).abs().max().item() < 2e-5 * max(1.0, ref.abs().max().item())


def test_half_precision_pools_are_widened_exactly():
    """bf16 and f16 rows are widened in vectors: f16 subnormals come out as the float32 torch makes of them (an
    output made of them alone, compared at its own scale, shows a widening that gets them wrong)."""
    q, cache, table, lens = _case(torch.float16, 2, 2, 32, lens=(40, 33))
    g = torch.Generator().manual_seed(3)
    tiny = torch.randint(-1023, 1024, cache[:, 1].shape, generator=g).float() * 2.0 ** -24  # every f16 subnormal
    cache[:, 1] = tiny.half()
    out = native.paged_decode_attention(q, cache, table, lens)
    ref = _reference(q, cache, table, lens)
    assert ref.abs().max().item() < 1e-4
    assert (out.double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slots_past_a_sequences_end_are_never_weighed(dtype):
    """Pages are not cleared between requests: the slots of a last page past the sequence's length may hold
    anything, NaN and infinities included, and change nothing."""
    q, cache, table, lens = _case(dtype, 4, 2, 32, lens=(1, 20, 37, 70))
    clean = native.paged_decode_attention(q, cache, table, lens)
    for b, n in enumerate(lens.tolist()):
        last = table[b, (n - 1) // 16]
        cache[last, :, n % 16 or 16:] = float("nan")
        cache[last, 1, n % 16 or 16:, 0] = float("inf")
    out = native.paged_decode_attention(q, cache, table, lens)
    assert torch.equal(out, clean)
