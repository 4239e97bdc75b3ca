"""Prefill's queue with a fake forward pass (it records what each pass packed): order, packing, chunking, page
waits, and the drops (deadline, caller gone, queue full) that must happen before a pass and only then."""
import asyncio
import threading
import time

import grpc
import pytest
from prometheus_client import REGISTRY

from pdserve.common.errors import PdError
from pdserve.engine.sampler import SamplingParams
from pdserve.prefill.batcher import Batcher
from pdserve.prefill.local_pages import LocalPages
from pdserve.prefill.worker import Forward, Prompt

PS = 4


class FakeForward:
    """Records each pass as [(prompt name, start, n)]; a prompt's 'first token' is its length. A gated pass
    waits (in the model's thread, as a real one runs) until the test opens the gate."""

    def __init__(self, gate_first: bool = False):
        self.passes: list[list[tuple[str, int, int]]] = []
        self.gate = threading.Event()
        if not gate_first:
            self.gate.set()
        self.started = threading.Event()

    def __call__(self, chunks):
        self.started.set()
        assert self.gate.wait(10), "the test never opened the gate"
        self.passes.append([(p.token_ids[0], s, n) for p, s, n in chunks])
        for p, s, n in chunks:
            assert len(p.pages) * PS >= s + n, "a chunk ran without its pages"
        return [Forward(len(p.token_ids), None, []) if s + n == len(p.token_ids) else None for p, s, n in chunks]


def prompt(name: int, n: int) -> Prompt:
    return Prompt([name] + [0] * (n - 1), SamplingParams())


def pool(num_pages: int) -> LocalPages:
    """Local pages with no prefix cache."""
    return LocalPages(num_pages, lambda pages: [0] * len(pages), max_cached_pages=0)


def metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def served(batcher: Batcher, p: Prompt, deadline: float | None = None) -> int:
    """A caller: runs the prompt, frees its pages (as the servicer does once the write is done)."""
    try:
        return (await batcher.result(batcher.submit(p, deadline))).first_token
    finally:
        if p.reservation is not None:
            batcher.local.finish(p.reservation)
        batcher.wake()


def test_prompts_are_packed_in_order_and_the_last_one_chunked_to_the_budget():
    async def main():
        fwd = FakeForward()
        b = Batcher(fwd, pool(64), PS, max_batch_tokens=64)
        firsts = await asyncio.gather(*(served(b, prompt(i, n)) for i, n in enumerate([10, 20, 5, 30], 1)))
        assert firsts == [10, 20, 5, 30]
        assert fwd.passes == [[(1, 0, 10), (2, 0, 20), (3, 0, 5), (4, 0, 29)], [(4, 29, 1)]]
        assert b.alloc.num_free == 64

    asyncio.run(main())


def test_a_long_prompt_takes_half_a_pass_while_short_ones_wait():
    async def main():
        fwd = FakeForward()
        b = Batcher(fwd, pool(64), PS, max_batch_tokens=16)
        before = metric("pdserve_prefill_sequences_total")
        await asyncio.gather(served(b, prompt(1, 40)), served(b, prompt(2, 4)), served(b, prompt(3, 4)))
        assert fwd.passes == [[(1, 0, 8), (2, 0, 4), (3, 0, 4)], [(1, 8, 16)], [(1, 24, 16)]]
        assert metric("pdserve_prefill_sequences_total") - before == 3  # a chunked prompt counts once
        fwd.passes.clear()  # behind a long prompt only another long one: first come, first served, whole passes
        await asyncio.gather(served(b, prompt(4, 40)), served(b, prompt(5, 20)))
        assert fwd.passes == [[(4, 0, 16)], [(4, 16, 16)], [(4, 32, 8), (5, 0, 8)], [(5, 8, 12)]]

    asyncio.run(main())


def test_the_head_waits_for_local_pages_and_nothing_overtakes_it():
    async def main():
        fwd = FakeForward()
        b = Batcher(fwd, pool(4), PS, max_batch_tokens=64)
        # 3 pages, then 2 (waits for the first to give its pages back), then 1 (would fit, must not overtake)
        await asyncio.gather(served(b, prompt(1, 12)), served(b, prompt(2, 8)), served(b, prompt(3, 4)))
        assert fwd.passes == [[(1, 0, 12)], [(2, 0, 8), (3, 0, 4)]]

    asyncio.run(main())


def test_work_whose_deadline_passes_or_whose_caller_left_is_dropped_before_its_pass():
    async def main():
        fwd = FakeForward(gate_first=True)
        b = Batcher(fwd, pool(64), PS, max_batch_tokens=64)
        drops = {r: metric("pdserve_prefill_dropped_total", reason=r) for r in ("deadline", "cancelled")}
        seqs, gone = metric("pdserve_prefill_sequences_total"), metric("pdserve_prefill_forward_for_gone_total")
        running = asyncio.ensure_future(served(b, prompt(1, 8)))
        await asyncio.to_thread(fwd.started.wait, 10)  # the first pass holds the model
        late = asyncio.ensure_future(served(b, prompt(2, 8), deadline=time.monotonic() + 0.05))
        leaving_item = b.submit(prompt(3, 8))
        leaving = asyncio.ensure_future(b.result(leaving_item))
        cancelled = asyncio.ensure_future(served(b, prompt(4, 8)))
        kept = asyncio.ensure_future(served(b, prompt(5, 8), deadline=time.monotonic() + 60))
        await asyncio.sleep(0.1)
        b.leave(leaving_item)  # as the servicer does when the caller's RPC is cancelled
        cancelled.cancel()
        await asyncio.sleep(0)
        fwd.gate.set()
        assert await running == 8 and await kept == 8
        with pytest.raises(PdError) as info:
            await late
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "nothing computed" in info.value.message
        with pytest.raises(PdError) as info:
            await leaving
        assert (info.value.code, info.value.reason) == (grpc.StatusCode.CANCELLED, "CALLER_LEFT")
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert fwd.passes == [[(1, 0, 8)], [(5, 0, 8)]]  # nothing was computed for the dropped ones
        assert metric("pdserve_prefill_dropped_total", reason="deadline") - drops["deadline"] == 1
        assert metric("pdserve_prefill_dropped_total", reason="cancelled") - drops["cancelled"] == 2
        assert metric("pdserve_prefill_sequences_total") - seqs == 2
        assert metric("pdserve_prefill_forward_for_gone_total") == gone
        assert b.alloc.num_free == 64 and metric("pdserve_prefill_queue_depth") == 0

    asyncio.run(main())


def test_a_full_queue_refuses_with_the_numbers():
    async def main():
        fwd = FakeForward(gate_first=True)
        b = Batcher(fwd, pool(64), PS, queue_limit=2)
        refusals = metric("pdserve_overload_rejections_total", service="prefill", reason="queue_full")
        queued = [asyncio.ensure_future(served(b, prompt(i, 4))) for i in (1, 2)]
        await asyncio.to_thread(fwd.started.wait, 10)
        assert metric("pdserve_prefill_queue_depth") == 0  # both in the held pass: counted by the limit, not waiting
        with pytest.raises(PdError) as info:
            b.submit(prompt(3, 4))
        assert (info.value.code, info.value.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "PREFILL_QUEUE_FULL")
        assert info.value.retry_after_s == 1.0  # no pass has run yet: no rate to estimate from
        assert "holds 2 prompts" in info.value.message and "--prefill-queue-limit 2" in info.value.message
        assert metric("pdserve_overload_rejections_total", service="prefill", reason="queue_full") - refusals == 1
        fwd.gate.set()
        assert await asyncio.gather(*queued) == [4, 4]
        assert await served(b, prompt(3, 4)) == 4  # room again

    asyncio.run(main())


def test_a_failed_pass_fails_its_prompts_and_the_queue_goes_on():
    async def main():
        calls = []

        def forward(chunks):
            calls.append(len(chunks))
            if len(calls) == 1:
                raise RuntimeError("out of memory")
            return [RuntimeError("sampling") if p.token_ids[0] == 3 else Forward(1, None, []) for p, _, _ in chunks]
        b = Batcher(forward, pool(64), PS, max_batch_tokens=8)
        first = await asyncio.gather(served(b, prompt(1, 4)), served(b, prompt(2, 4)), return_exceptions=True)
        assert [str(e) for e in first] == ["out of memory"] * 2
        second = await asyncio.gather(served(b, prompt(3, 4)), served(b, prompt(4, 4)), return_exceptions=True)
        assert str(second[0]) == "sampling" and second[1] == 1  # a prompt's own failure is its alone
        assert calls == [2, 2] and b.alloc.num_free == 64

    asyncio.run(main())


def test_queued_prompts_are_counted_waiting_and_their_queue_time_observed_as_they_start():
    """Issue 21: pdserve_requests_waiting reads num_waiting (prompts whose first pass has not started); each prompt's
    time in the queue is observed once, when it starts."""
    from types import SimpleNamespace

    from pdserve.prefill.servicer import PrefillServicer

    def started() -> float:
        return metric("pdserve_queue_time_seconds_count", service="prefill")

    async def main():
        fwd = FakeForward(gate_first=True)
        b = Batcher(fwd, pool(3), PS, max_batch_tokens=64)  # room for one of these prompts at a time
        before = started()
        tasks = [asyncio.create_task(served(b, prompt(i, 12))) for i in (1, 2, 3)]
        try:
            await asyncio.to_thread(fwd.started.wait, 10)  # the first pass runs (held at the gate)
            assert b.num_waiting == 2 and started() - before == 1
            # the servicer's view, with the three Prefill calls in flight (the first one's KV is being computed)
            assert PrefillServicer.load(SimpleNamespace(batcher=b, in_flight={1, 2, 3})) == (1, 2)
        finally:  # a failed check must not leave the pass, and the callers behind it, waiting at the gate
            fwd.gate.set()
            firsts = await asyncio.gather(*tasks, return_exceptions=True)
        assert firsts == [12, 12, 12]
        assert b.num_waiting == 0 and started() - before == 3
        assert [p[0][0] for p in fwd.passes] == [1, 2, 3]

    asyncio.run(main())
