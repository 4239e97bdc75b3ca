"""Prefill's forward passes run on one thread of their own, and OpenMP's wait policy is set before torch loads:
libgomp keeps a team of torch threads per thread that starts a parallel op, so passes that hop between asyncio's
worker threads leave a team on each of them."""
import asyncio
import os
import subprocess
import sys
import threading

from pdserve.prefill.batcher import Batcher
from pdserve.prefill.main import compute_threads
from pdserve.prefill.worker import Forward

from .test_batcher import PS, pool, prompt, served


class ThreadOfEachPass:
    def __init__(self):
        self.threads: list[tuple[int, str]] = []

    def __call__(self, chunks):
        self.threads.append((threading.get_native_id(), threading.current_thread().name))
        return [Forward(len(p.token_ids), None, []) if s + n == len(p.token_ids) else None for p, s, n in chunks]


def test_every_pass_runs_on_the_batchers_one_thread_while_other_work_holds_the_default_pool():
    fwd = ThreadOfEachPass()
    forward_pool = compute_threads(0, max_workers=1, name="prefill-forward")
    try:
        async def main():
            b = Batcher(fwd, pool(64), PS, max_batch_tokens=8)
            b.executor = forward_pool
            loop = asyncio.get_running_loop()
            busy = threading.Event()
            # the writes and checksums that share asyncio's default pool keep its threads busy meanwhile
            blockers = [loop.run_in_executor(None, busy.wait, 5) for _ in range(3)]
            firsts = []
            for i in range(6):  # one at a time: each pass finds the default pool's threads in a different state
                firsts.append(await served(b, prompt(i + 1, 4 + 8 * (i % 3))))
            busy.set()
            await asyncio.gather(*blockers)
            return firsts
        firsts = asyncio.run(main())
    finally:
        forward_pool.shutdown()
    assert firsts == [4, 12, 20, 4, 12, 20]
    assert len(fwd.threads) == 1 + 2 + 3 + 1 + 2 + 3  # passes of at most 8 tokens
    assert len(set(fwd.threads)) == 1 and fwd.threads[0][1].startswith("prefill-forward"), fwd.threads


def test_without_an_executor_passes_run_in_the_default_pool():
    fwd = ThreadOfEachPass()

    async def main():
        b = Batcher(fwd, pool(64), PS, max_batch_tokens=8)
        return await served(b, prompt(1, 4)), threading.get_native_id()
    first, loop_tid = asyncio.run(main())
    assert first == 4 and fwd.threads and fwd.threads[0][0] != loop_tid


def _env_after_import(env: dict) -> list[str]:
    code = ("import os; import pdserve.prefill.main as m; "
            "print(m._OMP_ENV_BEFORE_TORCH, os.environ.get('OMP_WAIT_POLICY'))")
    keep = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    return subprocess.run([sys.executable, "-c", code], env={**keep, **env}, capture_output=True, text=True,
                          check=True, timeout=120).stdout.split()


def test_the_wait_policy_is_set_before_torch_loads_and_an_operators_setting_stands():
    assert _env_after_import({}) == ["True", "PASSIVE"]
    assert _env_after_import({"OMP_WAIT_POLICY": "ACTIVE"}) == ["True", "ACTIVE"]
