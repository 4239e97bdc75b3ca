"""The native step's matrix product (csrc/decode_step.c's gemm) alone, both of its builds (16 lanes where the CPU has
AVX-512, 8 lanes elsewhere), at shapes the tiles do not divide: every output against float64, and bit for bit the same
whatever rows of x share the call and wherever a row lands in its tile of rows."""
import ctypes

import pytest
import torch

from pdserve.engine import native


def _lib():
    lib = native._load()
    assert lib is not None, native.status()  # make setup builds it; CI must run it
    fn = lib.pd_gemm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return fn


def _lanes():
    fn, z = _lib(), torch.zeros(16)
    return [8] + ([16] if fn(z.data_ptr(), 1, 16, z.data_ptr(), None, z.data_ptr(), 1, 16) == 0 else [])


def _gemm(x, w, b, lanes):
    y = torch.full((x.shape[0], w.shape[0]), float("nan"))
    rc = _lib()(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), None if b is None else b.data_ptr(),
                y.data_ptr(), w.shape[0], lanes)
    assert rc == 0
    return y


def test_the_step_uses_the_widest_product_the_cpu_has():
    x, w = torch.randn(3, 40), torch.randn(5, 40)
    assert torch.equal(_gemm(x, w, None, 0), _gemm(x, w, None, _lanes()[-1]))


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("K", [1, 7, 8, 15, 16, 17, 31, 33, 256, 261, 688])
@pytest.mark.parametrize("N", [1, 2, 3, 4, 5, 7, 9, 13])
def test_every_output_against_float64_and_alone(lanes, K, N):
    if lanes not in _lanes():
        pytest.skip("no AVX-512 on this CPU")
    g = torch.Generator().manual_seed(K * 100 + N)
    x, w, b = (torch.randn(17, K, generator=g), torch.randn(N, K, generator=g) / K ** 0.5,
               torch.randn(N, generator=g))
    ref = x.double() @ w.double().T + b.double()
    bound = 1e-6 * (x.double().abs() @ w.double().abs().T + b.double().abs()) + 1e-7 * K
    alone = torch.cat([_gemm(x[m:m + 1], w, b, lanes) for m in range(17)])
    assert ((alone.double() - ref).abs() <= bound).all()
    for M in range(1, 18):  # every count of rows: every tile of rows, full or partial, and every place in it
        y = _gemm(x[:M], w, b, lanes)
        assert torch.equal(y, alone[:M]), f"{M} rows"
    sums = torch.cat([_gemm(x[m:m + 1], w, None, lanes) for m in range(17)])
    assert torch.equal(_gemm(x[5:16], w, None, lanes), sums[5:16])
    assert torch.equal(alone, sums + b)  # the bias added to the sum, once


@pytest.mark.parametrize("lanes", [8, 16])
def test_rows_of_a_long_matrix_after_the_prefetched_blocks(lanes):
    """Past the first blocks of weight rows (each tile prefetches blocks ahead of it) and at the last one."""
    if lanes not in _lanes():
        pytest.skip("no AVX-512 on this CPU")
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(16, 256, generator=g), torch.randn(517, 256, generator=g) / 16
    y = _gemm(x, w, None, lanes)
    assert torch.allclose(y.double(), x.double() @ w.double().T, atol=1e-5, rtol=0)
    assert torch.equal(y[3], _gemm(x[3:4], w, None, lanes)[0])
