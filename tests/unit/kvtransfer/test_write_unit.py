"""The bounded write unit (issue 19, point 1): no batch call covers more than --max-write-bytes, whatever the pool's
size, so the landing bound is computed from the unit. split_calls cuts runs at page boundaries, in order, and the
engine refuses a call over its unit before it posts anything."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kvtransfer.engine import Run, TransferEngine, coalesce, split_calls


def _bytes(runs: list[Run]) -> list[tuple[int, int]]:
    """Every (src, dst) byte address the runs cover, in order."""
    return [(r.src + i, r.dst + i) for r in runs for i in range(r.nbytes)]


@settings(max_examples=200, deadline=None)
@given(pages=st.lists(st.integers(0, 40), min_size=0, max_size=30, unique=True),
       stride=st.sampled_from([1, 4, 16]), per_call=st.integers(1, 7), extra=st.integers(0, 3))
def test_calls_cover_the_runs_in_order_each_within_the_unit_and_cut_at_pages(pages, stride, per_call, extra):
    max_bytes = per_call * stride + min(extra, stride - 1)  # a unit that is not a multiple of a page, too
    runs = coalesce(pages, [p + 100 for p in pages], 0, 10_000, stride)
    calls = split_calls(runs, max_bytes, stride)
    assert all(0 < sum(r.nbytes for r in c) <= max_bytes for c in calls)
    assert all(r.nbytes % stride == 0 and r.src % stride == 0 for c in calls for r in c)  # no page is split
    assert _bytes([r for c in calls for r in c]) == _bytes(runs)  # the same bytes, in the same order
    assert len(calls) == -(-len(pages) // per_call)  # every call but the last is full: no more calls than needed


def test_a_pool_sized_run_becomes_unit_sized_calls():
    page = 65536
    runs = [Run(0, 1 << 40, 131072 * page)]  # the data of a 2,097,152-token pool of the tiny model: 8 GiB
    calls = split_calls(runs, 32 << 20, page)
    assert len(calls) == 256 and {sum(r.nbytes for r in c) for c in calls} == {32 << 20}
    assert calls[1] == [Run(32 << 20, (1 << 40) + (32 << 20), 32 << 20)]


def test_a_page_larger_than_the_unit_is_refused():
    with pytest.raises(ValueError, match="one page of 65536 bytes does not fit in a write unit of 65535 bytes"):
        split_calls([Run(0, 0, 65536)], 65535, 65536)


def test_the_engine_refuses_a_call_over_its_unit_before_posting():
    src_eng = TransferEngine("127.0.0.1", "tcp", max_write_bytes=512)
    dst_eng = TransferEngine("127.0.0.1", "tcp")
    src = torch.full((1024,), 7, dtype=torch.uint8)
    dst = torch.zeros(1024, dtype=torch.uint8)
    src_eng.register(src.data_ptr(), src.numel())
    dst_eng.register(dst.data_ptr(), dst.numel())
    with pytest.raises(ValueError, match=r"a batch call of 2 runs \(768 bytes\) exceeds the write unit of 512 bytes"):
        src_eng.write(dst_eng.session, [Run(src.data_ptr(), dst.data_ptr(), 512),
                                        Run(src.data_ptr() + 512, dst.data_ptr() + 512, 256)], stage="data")
    assert int(dst.count_nonzero()) == 0  # nothing was posted
    assert src_eng.write(dst_eng.session, [Run(src.data_ptr(), dst.data_ptr(), 512)], stage="data") == 512
    assert dst[:512].eq(7).all() and int(dst[512:].count_nonzero()) == 0
