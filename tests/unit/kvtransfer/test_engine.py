"""Transfer engine: run coalescing and real one-sided Mooncake writes over loopback TCP."""
import pytest
import torch

from pdserve.kvtransfer.engine import Run, TransferEngine, TransferError, coalesce

STRIDE = 256
NPAGES = 16


def test_coalesce_contiguous_is_one_run():
    runs = coalesce([4, 5, 6, 7], [10, 11, 12, 13], 1000, 50000, STRIDE)
    assert runs == [Run(1000 + 4 * STRIDE, 50000 + 10 * STRIDE, 4 * STRIDE)]


def test_coalesce_breaks_on_either_side():
    # source contiguous, destination not (and vice versa); a backwards step never joins
    runs = coalesce([0, 1, 2, 3, 4, 9, 8], [7, 8, 20, 21, 30, 31, 32], 0, 1 << 20, 64)
    assert runs == [
        Run(0 * 64, (1 << 20) + 7 * 64, 2 * 64),
        Run(2 * 64, (1 << 20) + 20 * 64, 2 * 64),
        Run(4 * 64, (1 << 20) + 30 * 64, 64),
        Run(9 * 64, (1 << 20) + 31 * 64, 64),
        Run(8 * 64, (1 << 20) + 32 * 64, 64),
    ]
    assert sum(r.nbytes for r in runs) == 7 * 64


def test_coalesce_single_and_empty():
    assert coalesce([3], [0], 8, 16, 4) == [Run(8 + 12, 16, 4)]
    assert coalesce([], [], 8, 16, 4) == []


def test_coalesce_mismatched_lengths():
    with pytest.raises(ValueError, match="3 source pages for 2 destination pages"):
        coalesce([0, 1, 2], [0, 1], 0, 0, STRIDE)


@pytest.fixture(scope="module")
def engines():
    return TransferEngine("127.0.0.1", "tcp"), TransferEngine("127.0.0.1", "tcp")


@pytest.fixture(scope="module")
def regions(engines):
    src_eng, dst_eng = engines
    src = torch.arange(NPAGES * STRIDE, dtype=torch.int64).remainder(251).to(torch.uint8) + 1  # never 0
    dst = torch.zeros(NPAGES * STRIDE, dtype=torch.uint8)
    src_eng.register(src.data_ptr(), src.numel())
    dst_eng.register(dst.data_ptr(), dst.numel())
    return src, dst


def test_session_names_the_rpc_port(engines):
    a, b = engines
    assert a.session.startswith("127.0.0.1:") and b.session.startswith("127.0.0.1:")
    assert a.session != b.session


def test_write_coalesced_runs(engines, regions):
    src_eng, dst_eng = engines
    src, dst = regions
    dst.fill_(0xFF)
    src_pages = [0, 1, 2, 7, 8, 12]
    dst_pages = [3, 4, 5, 10, 11, 0]
    runs = coalesce(src_pages, dst_pages, src.data_ptr(), dst.data_ptr(), STRIDE)
    assert len(runs) == 3
    moved = src_eng.write(dst_eng.session, runs, stage="data")
    assert moved == 6 * STRIDE
    s = src.view(NPAGES, STRIDE)
    d = dst.view(NPAGES, STRIDE)
    for sp, dp in zip(src_pages, dst_pages):
        assert torch.equal(d[dp], s[sp]), (sp, dp)
    untouched = [p for p in range(NPAGES) if p not in dst_pages]
    assert bool((d[untouched] == 0xFF).all())
    assert not bool((d[dst_pages] == 0xFF).any())  # the source holds 1..251, never the marker


def test_write_no_runs_moves_nothing(engines, regions):
    src_eng, dst_eng = engines
    assert src_eng.write(dst_eng.session, [], stage="tags") == 0


def test_write_to_unregistered_destination_raises(engines, regions):
    src_eng, dst_eng = engines
    src, _ = regions
    elsewhere = torch.zeros(STRIDE, dtype=torch.uint8)  # never registered with the destination engine
    runs = [Run(src.data_ptr(), elsewhere.data_ptr(), STRIDE)]
    with pytest.raises(TransferError) as e:
        src_eng.write(dst_eng.session, runs, stage="tags")
    assert e.value.stage == "tags"
    assert dst_eng.session in str(e.value) and f"{STRIDE} bytes" in str(e.value)
    assert bool((elsewhere == 0).all())


def test_fault_fail_then_land_reports_failure_then_lands_what_the_source_holds_then(engines, regions, monkeypatch):
    """What a failed batch call can leave behind: the bytes still arrive, and they are whatever the source pages
    hold when the task runs, so a source page reused after the failure would carry the next request's KV."""
    import time

    from pdserve.common.faults import FAULTS

    monkeypatch.setattr(FAULTS, "enabled", True)
    src_eng, dst_eng = engines
    src, dst = regions
    dst.fill_(0xFF)
    FAULTS.arm("transfer.fail_then_land", 1, "300")
    runs = coalesce([0], [5], src.data_ptr(), dst.data_ptr(), STRIDE)
    with pytest.raises(TransferError) as e:
        src_eng.write(dst_eng.session, runs, stage="data")
    assert e.value.posted and "land in 0.300s" in str(e.value)
    d = dst.view(NPAGES, STRIDE)
    assert bool((d[5] == 0xFF).all())  # reported failed, nothing there yet
    s = src.view(NPAGES, STRIDE)
    original = s[0].clone()
    s[0].fill_(0x42)  # the source page reused by the next request before the late write ran
    try:
        deadline = time.monotonic() + 5
        while not bool((d[5] == 0x42).all()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert bool((d[5] == 0x42).all())  # the "failed" write landed, carrying the reused page's bytes
    finally:
        s[0].copy_(original)


def test_timeout_is_explicit_and_refuses_what_mooncake_would_silently_raise(monkeypatch):
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "300")  # inherited from a shell: must not be what is used
    with pytest.raises(ValueError, match="whole seconds >= 5"):
        TransferEngine("127.0.0.1", "tcp", timeout_s=2)
    eng = TransferEngine("127.0.0.1", "tcp", timeout_s=6)
    import os
    assert eng.timeout_s == 6 and os.environ["MC_TRANSFER_TIMEOUT"] == "6"
