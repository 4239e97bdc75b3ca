"""A prefill-only runner (its linears on oneDNN's packed weights) computes what the plain runner computes, keeps no
plain copy of the weights, and a linear folded into a packed one cannot be called by mistake."""
import pytest
import torch

from pdserve.engine import packed_linear
from pdserve.engine.runner import Chunk, ModelRunner

PS = 16

pytestmark = pytest.mark.skipif(packed_linear.why_not(torch.zeros(1)) is not None,
                                reason=f"oneDNN: {packed_linear.why_not(torch.zeros(1))}")


@pytest.fixture(scope="module")
def runners(model_dir):
    return ModelRunner(model_dir, 64, PS), ModelRunner(model_dir, 64, PS, prefill_only=True)


def _prompt(n, seed):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def test_packed_prefill_matches_plain_logits_and_kv(runners):
    plain, packed = runners
    assert "oneDNN, weights packed once" in packed.describe(4096)
    assert "linears: F.linear;" in plain.describe(4096)
    long = _prompt(150, 3)  # three pages and a part, in two chunks on the packed side: the prefix read back
    plain.pool.kv.zero_()
    packed.pool.kv.zero_()
    want = plain.prefill(long, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], all_logits=True)
    first = packed.prefill_batch([Chunk(long[:70], 0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], True)])[0]
    second = packed.prefill_batch([Chunk(long[70:], 70, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], True)])[0]
    got = torch.cat([first, second])
    assert got.shape == want.shape == (150, 512)
    assert (got - want).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (packed.pool.kv[1:11] - plain.pool.kv[1:11]).abs().max().item() < 1e-4
    assert packed.pool.kv[1:11].abs().sum() > 0  # the comparison above is over written pages


def test_no_plain_weight_is_left_beside_a_packed_one(runners):
    plain, packed = runners
    dense = lambda m: {id(t.untyped_storage()) if not t.is_mkldnn else id(t): t  # noqa: E731
                       for t in list(m.parameters()) + list(m.buffers())}
    kept = [t for t in dense(packed.model).values() if not t.is_mkldnn and t.dim() == 2]
    # what stays plain: the embedding (a lookup, not a GEMM) and nothing else of two dimensions
    assert [tuple(t.shape) for t in kept] == [tuple(plain.model.model.embed_tokens.weight.shape)]
    assert sum(t.is_mkldnn for t in dense(packed.model).values()) == 2 * 4 + 1  # o and down a layer, the head
    for layer in packed.model.model.layers:  # the fused ones sit beside the modules, as fuse() left them
        assert layer.self_attn.qkv[0].is_mkldnn and layer.mlp.gate_up[0].is_mkldnn


def test_a_projection_folded_into_a_packed_one_refuses(runners):
    _, packed = runners
    attn = packed.model.model.layers[0].self_attn
    with pytest.raises(RuntimeError, match="q_proj's weight was packed into qkv"):
        attn.q_proj(torch.zeros(1, 256))
    with pytest.raises(RuntimeError, match="up_proj's weight was packed into gate_up"):
        packed.model.model.layers[0].mlp.up_proj(torch.zeros(1, 256))


def test_a_prefill_only_runner_builds_no_decode_step(runners):
    plain, packed = runners
    assert plain.native_step is not None and packed.native_step is None


def test_packing_frees_the_plain_weights(model_dir):
    import gc
    import weakref

    from pdserve.engine.loader import load_model
    model = load_model(model_dir)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    plain = [weakref.ref(t) for t in (attn.qkv[0], mlp.gate_up[0], attn.o_proj.weight, mlp.down_proj.weight,
                                      model.lm_head.weight)]
    model.pack()
    gc.collect()
    assert [r() is None for r in plain] == [True] * 5
