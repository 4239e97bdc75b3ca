"""Prefill cuts every write into batch calls of at most its write unit (issue 19, point 1): data first, then tags,
each call behind its own liveness check, so the landing bound holds from every call's post however long the whole
write takes. A write whose liveness ends midway posts nothing more."""
from types import SimpleNamespace

import pytest

from pdserve.engine.runner import ModelRunner
from pdserve.engine.tags import TAG_NBYTES
from pdserve.kvtransfer.engine import TransferError, coalesce
from pdserve.prefill.worker import PrefillWorker, Progress, Target

PAGE = 16


class RecordingTransfer:
    def __init__(self):
        self.calls: list[tuple[str, list]] = []

    def register(self, ptr, nbytes):
        pass

    def write(self, session, runs, stage, owner=b""):
        self.calls.append((stage, runs))
        return sum(r.nbytes for r in runs)


@pytest.fixture(scope="module")
def runner(model_dir):
    return ModelRunner(model_dir, num_pages=32, page_size=PAGE, device="cpu")


def _write(runner, unit_pages: int, local: list[int], dest: list[int], check_alive):
    transfer = RecordingTransfer()
    worker = PrefillWorker(runner, transfer, max_write_bytes=unit_pages * runner.pool.page_nbytes)
    target = Target("peer:1", data_base=1 << 40, tag_base=1 << 41, epoch=3, leases=[(d, 1) for d in dest])
    progress = Progress()
    try:
        written = worker.write(b"o" * 16, local, len(local) * PAGE - 5, target, check_alive, progress)
    except TransferError as e:
        written = e
    return worker, transfer, progress, written, target


def test_a_write_goes_out_in_unit_sized_calls_data_first_each_behind_a_liveness_check(runner):
    local, dest = [0, 1, 2, 3, 4, 5, 6, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    stages = []
    worker, transfer, progress, written, target = _write(runner, 3, local, dest, stages.append)
    pb = runner.pool.page_nbytes
    assert [s for s, _ in transfer.calls] == ["data"] * 4 + ["tags"]  # no tag is posted before all the data
    assert [sum(r.nbytes for r in runs) // pb for s, runs in transfer.calls if s == "data"] == [3, 3, 3, 1]
    assert stages == ["data"] * 4 + ["tags"]  # one check per call, before it
    # the calls cover exactly the pages of one unsplit write, page i of the prompt onto lease i
    data = [r for s, runs in transfer.calls if s == "data" for r in runs]
    want = coalesce(local, dest, runner.pool.data_ptr, target.data_base, pb)
    assert sorted((r.src, r.dst, r.nbytes) for r in _pages(data, pb)) == sorted(
        (r.src, r.dst, r.nbytes) for r in _pages(want, pb))
    assert transfer.calls[-1][1] == coalesce(local, dest, runner.pool.tag_ptr, target.tag_base, TAG_NBYTES)
    assert progress.posted and written.num_pages == 10 and written.nbytes == 10 * pb + 10 * TAG_NBYTES


def _pages(runs, stride):
    return [SimpleNamespace(src=r.src + i, dst=r.dst + i, nbytes=stride) for r in runs for i in range(0, r.nbytes,
                                                                                                      stride)]


def test_a_liveness_lapse_midway_posts_no_further_call(runner):
    seen = []

    def check_alive(stage):
        seen.append(stage)
        if len(seen) == 3:
            raise TransferError("liveness", "writer w: liveness lease has 0.50s left, under the 1.0s margin")

    _, transfer, progress, err, _ = _write(runner, 2, list(range(8)), list(range(8, 16)), check_alive)
    assert isinstance(err, TransferError) and err.stage == "liveness"
    assert [s for s, _ in transfer.calls] == ["data", "data"]  # the third call and every tag never went out
    assert progress.posted  # what was posted may still land: the caller holds the pages for the bound


def test_a_page_larger_than_the_unit_is_refused_at_construction(runner):
    pb = runner.pool.page_nbytes
    with pytest.raises(ValueError, match=f"one KV page of {pb} bytes does not fit in the write unit of {pb - 1} bytes"):
        PrefillWorker(runner, RecordingTransfer(), max_write_bytes=pb - 1)
