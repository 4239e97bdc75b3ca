"""A prefill pass's row-wise ops on the native library (native_prefill.rope_kv, rms_norm, silu_mul) against the torch
ops they replace: RoPE and the K/V write bit for bit (decode reads that K), the others within float32 rounding; a
slot outside the pool is refused before any byte moves; and a model pass takes them."""
import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import native_prefill
from pdserve.engine.rope import RotaryEmbedding, apply_rope
from pdserve.engine.runner import ModelRunner


def _qkv(T, H, kvh, D, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, (H + 2 * kvh) * D, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, H, kvh, D, ps", [(37, 8, 4, 32, 16), (5, 4, 4, 64, 8), (130, 12, 2, 16, 16)])
def test_rope_and_the_kv_write_are_the_torch_paths_bit_for_bit(dtype, T, H, kvh, D, ps):
    num_pages = -(-T // ps) + 3
    qkv = _qkv(T, H, kvh, D, T * H + D)
    pos = torch.arange(100, 100 + T)
    cos, sin = RotaryEmbedding(D, 10000.0)(pos)
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(T))
    slot_pages, slot_offsets = perm[pos // ps - 100 // ps], pos % ps
    ref_pool = torch.full((num_pages, 2, ps, kvh, D), float("nan"), dtype=dtype)
    pool = ref_pool.clone()

    view = qkv.view(T, H + 2 * kvh, D)
    q, k, v = view[:, :H], view[:, H:H + kvh], view[:, H + kvh:]
    ref_q, ref_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    ref_pool[slot_pages, 0, slot_offsets] = ref_k.to(dtype)
    ref_pool[slot_pages, 1, slot_offsets] = v.to(dtype)
    ref_v = v.clone()

    assert native_prefill.rope_kv_supported(qkv, cos, pool)
    native_prefill.rope_kv(qkv, cos, sin, pool, slot_pages, slot_offsets, H)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k) and torch.equal(v, ref_v)  # in place, in qkv
    assert torch.equal(pool.nan_to_num(7.0), ref_pool.nan_to_num(7.0))  # the same slots, nothing else


def test_a_slot_outside_the_pool_is_refused_before_any_byte_moves():
    T, H, kvh, D, ps = 6, 4, 2, 16, 4
    qkv = _qkv(T, H, kvh, D, 1)
    before = qkv.clone()
    cos, sin = RotaryEmbedding(D, 10000.0)(torch.arange(T))
    pool = torch.zeros(3, 2, ps, kvh, D)
    pages, offsets = torch.tensor([0, 0, 1, 1, 2, 3]), torch.tensor([0, 1, 0, 1, 0, 0])
    with pytest.raises(ValueError, match="a page id outside the pool"):
        native_prefill.rope_kv(qkv, cos, sin, pool, pages, offsets, H)
    with pytest.raises(ValueError, match="a page id outside the pool"):  # an offset past the page
        native_prefill.rope_kv(qkv, cos, sin, pool, pages.clamp(max=2), offsets + 3, H)
    assert torch.equal(qkv, before) and not pool.any()


@pytest.mark.parametrize("rows, dim", [(1, 256), (33, 256), (7, 40)])
def test_rms_norm_and_silu_mul_match_torch_within_rounding(rows, dim):
    g = torch.Generator().manual_seed(rows * dim)
    x, w = torch.randn(rows, dim, generator=g) * 3, torch.randn(dim, generator=g)
    y = native_prefill.rms_norm(x, w, 1e-5)
    ref = F.rms_norm(x.double(), (dim,), w.double(), 1e-5)
    assert (y.double() - ref).abs().max().item() < 1e-5 * (1 + ref.abs().max().item())

    gu = torch.randn(rows, 2 * dim, generator=g) * 4
    act = native_prefill.silu_mul(gu)
    gate, up = gu.double().chunk(2, dim=-1)
    ref = F.silu(gate) * up
    assert (act.double() - ref).abs().max().item() < 1e-5 * (1 + ref.abs().max().item())


def test_what_the_row_kernels_do_not_take_is_left_to_torch():
    x = torch.randn(4, 8)
    assert native_prefill.rms_norm(x.double(), torch.ones(8, dtype=torch.float64), 1e-5) is None
    assert native_prefill.rms_norm(x.t(), torch.ones(4), 1e-5) is None  # not contiguous
    assert native_prefill.silu_mul(x.view(2, 2, 8)) is None
    assert not native_prefill.rope_kv_supported(x, torch.ones(4, 1, 8), None)


@torch.inference_mode()
def test_a_prefill_pass_runs_them_and_gives_the_torch_paths_logits(model_dir, monkeypatch):
    """The same prompt through the row kernels and through torch's ops: the same K/V bit for bit is not asked here
    (RMSNorm and SiLU round differently), only logits within float32 noise and the same greedy token; each kernel is
    counted once per layer."""
    runner = ModelRunner(model_dir, num_pages=32, page_size=16, device="cpu", prefill_only=True)
    ids = torch.randint(0, runner.config.vocab_size, (90,), generator=torch.Generator().manual_seed(5)).tolist()
    calls = {"rope_kv": 0, "silu_mul": 0}
    for name in calls:
        fn = getattr(native_prefill, name)
        monkeypatch.setattr(native_prefill, name, lambda *a, _n=name, _f=fn: calls.__setitem__(_n, calls[_n] + 1)
                            or _f(*a))
    native = runner.prefill(ids, list(range(6)), all_logits=True)
    layers = runner.config.num_hidden_layers
    assert calls == {"rope_kv": layers, "silu_mul": layers}
    native_kv = runner.pool.kv[:6].clone()

    monkeypatch.setattr(native_prefill, "rows", lambda: None)
    torch_path = runner.prefill(ids, list(range(6, 12)), all_logits=True)
    assert (native - torch_path).abs().max().item() < 1e-4
    assert native.argmax(-1).tolist() == torch_path.argmax(-1).tolist()
    assert (native_kv - runner.pool.kv[6:12]).abs().max().item() < 1e-4
