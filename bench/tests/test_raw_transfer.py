"""The bench's raw Mooncake floor posts what prefill would: batch calls of at most the write unit, over the real
engine to a real peer process; and a bench run writes where git does not look."""
import os
import subprocess

from pdserve.bench.peers.mooncake_raw import TAG_NBYTES, RawMooncake
from pdserve.bench.harness.common import COMMITTED, RESULTS, ROOT
from pdserve.kvtransfer.engine import DEFAULT_MAX_WRITE_BYTES


def test_a_transfer_larger_than_the_write_unit_goes_as_calls_within_it():
    nbytes = 2 * DEFAULT_MAX_WRITE_BYTES + (5 << 20)  # 69 MiB: the old size sweep's 64 MiB call and more
    raw = RawMooncake(nbytes)
    try:
        assert raw.engine.max_write_bytes == DEFAULT_MAX_WRITE_BYTES
        calls = []
        real_write = raw.engine.write

        def recording(session, runs, stage):
            moved = real_write(session, runs, stage)
            calls.append((stage, [(r.src - (raw.data if stage == "data" else raw.tags).data_ptr(), r.nbytes)
                                  for r in runs], moved))
            return moved

        raw.engine.write = recording
        times = raw.measure(nbytes, 4 * TAG_NBYTES, repeats=1)
    finally:
        raw.close()
    assert len(times) == 1 and times[0] > 0
    per_write = len(calls) // 2  # measure's warm-up write, then the measured one: the same calls
    assert calls[:per_write] == calls[per_write:]
    data = [c for c in calls[:per_write] if c[0] == "data"]
    tags = [c for c in calls[:per_write] if c[0] == "tags"]
    print(f"one {nbytes}-byte transfer: data calls of {[c[2] for c in data]} bytes, tag calls {[c[2] for c in tags]}")
    assert all(moved <= DEFAULT_MAX_WRITE_BYTES for _, _, moved in data)
    # the calls, in order, cover every byte once
    runs = [run for _, rs, _ in data for run in rs]
    assert [off for off, _ in runs] == [sum(n for _, n in runs[:i]) for i in range(len(runs))]
    assert sum(n for _, n in runs) == nbytes and len(data) == 3
    assert [c[2] for c in tags] == [4 * TAG_NBYTES]


def test_a_run_writes_an_ignored_folder_and_the_committed_tables_are_elsewhere():
    assert RESULTS != COMMITTED
    probe = os.path.join(RESULTS, "bench-quick.json")
    ignored = subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT)
    assert ignored.returncode == 0, f"{probe} is not git-ignored: a bench run would dirty the checkout"
    tracked = subprocess.run(["git", "ls-files", os.path.relpath(COMMITTED, ROOT)], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    assert "bench/results/bench-quick.md" in tracked
