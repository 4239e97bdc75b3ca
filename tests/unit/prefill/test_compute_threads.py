"""Prefill's compute threads: below the rest of the process by --compute-nice, and so are the torch threads they
start (a Linux thread inherits its creator's nice value)."""
import asyncio
import os
import sys
import threading

import pytest
import torch

from pdserve.prefill.main import add_args, compute_threads

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="a nice value per thread is Linux's")


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def _task_nices() -> dict[int, int]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                out[int(tid)] = int(f.read().rpartition(")")[2].split()[16])  # field 19: nice
        except (FileNotFoundError, ProcessLookupError):  # a thread an earlier test left ended between the two reads
            continue
    return out


def test_a_worker_thread_runs_that_much_lower_and_the_loop_does_not():
    base = _nice(threading.get_native_id())
    pool = compute_threads(7, max_workers=2)
    try:
        async def main():
            loop = asyncio.get_running_loop()
            loop.set_default_executor(pool)
            return await asyncio.to_thread(lambda: _nice(threading.get_native_id())), _nice(threading.get_native_id())
        worker, loop_thread = asyncio.run(main())
    finally:
        pool.shutdown()
    assert worker == min(19, base + 7) and loop_thread == base


def test_the_torch_threads_a_forward_starts_inherit_it():
    base = _nice(threading.get_native_id())
    # clamped as compute_threads clamps: a process already at nice 15 or more still checks the clamp (tests run
    # at the nice they were started with; `make test` starts them at 0)
    want = min(19, base + 5)
    before = set(_task_nices())
    pool = compute_threads(5, max_workers=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)

        def matmul():
            # a fresh thread starts its own OpenMP team on its first parallel op
            a = torch.randn(512, 512)
            for _ in range(3):
                a = a @ a / 512
            return threading.get_native_id()
        tid = pool.submit(matmul).result()
        new = {t: n for t, n in _task_nices().items() if t not in before}
    finally:
        torch.set_num_threads(threads)
        pool.shutdown()
    assert tid in new and len(new) >= 2, new  # the worker and at least one torch thread it started
    assert set(new.values()) == {want}, new


def test_nothing_lowered_at_zero_and_the_flag_bounds():
    pool = compute_threads(0, max_workers=1)
    try:
        assert pool.submit(lambda: _nice(threading.get_native_id())).result() == _nice(threading.get_native_id())
    finally:
        pool.shutdown()
    import argparse
    p = argparse.ArgumentParser()
    add_args(p)
    assert p.parse_args([]).compute_nice == 10
    with pytest.raises(SystemExit):
        p.parse_args(["--compute-nice", "20"])


def _cgroup(tmp_path, proc_line: str, files: dict[str, str]) -> tuple[str, str]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(proc_line)
    return str(root), str(proc)


def test_the_thread_count_is_the_affinity_capped_by_a_cgroup_quota(tmp_path):
    from pdserve.engine.runner import available_cpus
    affinity = len(os.sched_getaffinity(0))
    # v2, the group's own limit: 1.5 cores run on 2 threads (one would leave half a core unused)
    root, proc = _cgroup(tmp_path / "a", "0::/pod/ctr\n", {"pod/ctr/cpu.max": "150000 100000\n",
                                                           "pod/cpu.max": "max 100000\n"})
    assert available_cpus(root, proc) == min(affinity, 2)
    # a parent's tighter limit applies to its children
    root, proc = _cgroup(tmp_path / "b", "0::/pod/ctr\n", {"pod/ctr/cpu.max": "max 100000\n",
                                                           "pod/cpu.max": "50000 100000\n"})
    assert available_cpus(root, proc) == 1
    # v1 (a hybrid host): cpu.cfs_quota_us under the cpu controller's mount
    root, proc = _cgroup(tmp_path / "c", "3:cpuset:/\n2:cpu,cpuacct:/ctr\n0::/\n",
                         {"cpu,cpuacct/ctr/cpu.cfs_quota_us": "100000\n",
                          "cpu,cpuacct/ctr/cpu.cfs_period_us": "100000\n"})
    assert available_cpus(root, proc) == 1
    # no quota (-1, max) or no cgroup files: the affinity alone, not os.cpu_count()
    root, proc = _cgroup(tmp_path / "d", "2:cpu,cpuacct:/\n0::/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                                                                      "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
                                                                      "cpu.max": "max 100000\n"})
    assert available_cpus(root, proc) == affinity
    assert available_cpus(str(tmp_path / "none"), str(tmp_path / "none")) == affinity


def test_the_affinity_bounds_it_below_the_hosts_cores(tmp_path):
    from pdserve.engine.runner import available_cpus
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("one core: nothing to narrow")
    one = {min(before)}

    def narrowed():
        os.sched_setaffinity(0, one)  # this thread alone: the test's other threads keep theirs
        try:
            return available_cpus(str(tmp_path / "none"), str(tmp_path / "none"))
        finally:
            os.sched_setaffinity(0, before)
    got = []
    t = threading.Thread(target=lambda: got.append(narrowed()))
    t.start()
    t.join()
    assert got == [1] and os.cpu_count() >= 2
