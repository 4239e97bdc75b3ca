"""The scheduler over a real model and pool while a step is in flight (issue 18): a step that stalls keeps its
owners held (so decode's KeepAlive lists them and the broker keeps their revoked pages) until it returns; a
sequence revoked or cancelled during the step gets none of its tokens and is released only after it; a decode
that went blind during the step sends none of its tokens; past --max-batch the batch rotates, so every running
sequence makes progress."""
import asyncio
import threading

import grpc
import pytest

from pdserve.common.errors import PdError
from pdserve.decode.scheduler import Scheduler
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampler import SamplingParams
from tests.unit.decode.test_scheduler_steps import PS, _admit, _prompt

REVOKED = PdError(grpc.StatusCode.DATA_LOSS, "REVOKED", "the broker revoked this request's leases: TEST")
BLIND = PdError(grpc.StatusCode.UNAVAILABLE, "WATCH_BLIND", "decode has not heard from the stream for 2.00s")


@pytest.fixture(scope="module")
def runner(model_dir):
    return ModelRunner(model_dir, num_pages=160, page_size=PS, device="cpu")


class Gate:
    """Wraps runner.run_decode (the step in the worker thread): the step numbered `hold_at` waits there until
    released."""

    def __init__(self, runner, hold_at: int | None = None):
        self.runner, self.run_decode, self.hold_at = runner, runner.run_decode, hold_at
        self.steps, self.entered, self.go = 0, threading.Event(), threading.Event()
        self.batches: list[list[int]] = []  # per step: the first page of each sequence in it
        runner.run_decode = self

    def __call__(self, inputs):
        self.steps += 1
        self.batches.append(inputs.table[:, 0].tolist())
        if self.steps == self.hold_at:
            self.entered.set()
            assert self.go.wait(30)
        return self.run_decode(inputs)

    def restore(self):
        self.runner.run_decode = self.run_decode


def _seqs(runner, n: int, max_tokens: int, pages_each: int):
    out = []
    for i in range(n):
        prompt = _prompt(20, seed=100 + i)
        out.append((prompt, _admit(runner, 1 + i, prompt, i * pages_each, max_tokens,
                                   SamplingParams(max_tokens=max_tokens))))
    return out


def _scheduler(runner, released: list, blind=lambda: None, max_batch: int = 64) -> Scheduler:
    async def release(seq):
        released.append(seq.owner)
    return Scheduler(runner, release, max_batch=max_batch, sweep_pages=0, blind=blind)


async def _events(seq) -> list:
    out = []
    while not out or not (isinstance(out[-1], PdError) or out[-1][1]):
        out.append(await asyncio.wait_for(seq.events.get(), 60))
    return out


def test_a_stalled_step_holds_its_owners_and_a_sequence_revoked_or_cancelled_during_it_gets_no_token(runner,
                                                                                                      oracle):
    async def main():
        gate = Gate(runner, hold_at=2)
        released = []
        s = _scheduler(runner, released)
        (p0, revoked), (p1, cancelled), (p2, kept) = _seqs(runner, 3, 4, 2)
        for seq in (revoked, cancelled, kept):
            s.join(seq)
            s.add(seq)
        loop = asyncio.create_task(s.run())
        try:
            assert await asyncio.to_thread(gate.entered.wait, 30)
            # the second step stalls in its thread; the event loop goes on and the broker revokes one owner
            s.revoke(revoked.owner, REVOKED)
            s.cancel(cancelled.owner)
            await asyncio.sleep(0.2)
            for seq in (revoked, cancelled, kept):  # still held: decode's KeepAlive keeps listing them
                assert seq.owner in s.stepping and s.holds(seq.owner)
            assert released == []  # nothing released while the step may still write the pages
            gate.go.set()
            got = {seq.owner: await _events(seq) for seq in (revoked, kept)}
            await asyncio.sleep(0.1)
        finally:
            loop.cancel()
            gate.restore()
        # one token from the first step, then the revocation: not the stalled step's token
        assert len(got[revoked.owner]) == 2 and got[revoked.owner][-1] is REVOKED
        assert not cancelled.events.empty() or cancelled.done
        assert len(cancelled.generated) == 2  # the first token and the first step's: not the stalled step's
        assert [e[0] for e in got[kept.owner]] == kept.generated[1:] and len(kept.generated) == 4
        oracle.check(p2, kept.generated)
        assert s.stepping == frozenset() and not any(s.holds(q.owner) for q in (revoked, cancelled, kept))
        assert sorted(released) == sorted([revoked.owner, cancelled.owner, kept.owner])
    asyncio.run(main())


def test_a_decode_that_goes_blind_during_a_step_sends_none_of_its_tokens(runner):
    async def main():
        gate = Gate(runner, hold_at=1)
        state = {"blind": None}
        released = []
        s = _scheduler(runner, released, blind=lambda: state["blind"])
        [(_, seq)] = _seqs(runner, 1, 4, 2)
        s.join(seq)
        s.add(seq)
        loop = asyncio.create_task(s.run())
        try:
            assert await asyncio.to_thread(gate.entered.wait, 30)
            state["blind"] = BLIND  # the stream fell silent while the step ran
            gate.go.set()
            events = await _events(seq)
        finally:
            loop.cancel()
            gate.restore()
        assert events == [BLIND] and seq.generated == seq.generated[:1]
    asyncio.run(main())


def test_past_max_batch_every_running_sequence_gets_a_token_every_few_steps(runner, oracle):
    """10 sequences, a batch of 4: each waits at most ceil(10 / 4) = 3 steps between two tokens (the old loop
    stepped the first 4 until they finished while the other 6 waited)."""
    async def main():
        gate = Gate(runner)
        released = []
        s = _scheduler(runner, released, max_batch=4)
        seqs = _seqs(runner, 10, 9, 2)
        for _, seq in seqs:
            s.join(seq)
            s.add(seq)
        loop = asyncio.create_task(s.run())
        try:
            events = await asyncio.gather(*(_events(seq) for _, seq in seqs))
        finally:
            loop.cancel()
            gate.restore()
        assert all(len(e) == 8 and not isinstance(e[-1], PdError) for e in events)
        for _, seq in seqs:  # the steps that stepped it, numbered from 1
            steps = [i + 1 for i, firsts in enumerate(gate.batches) if seq.pages[0] in firsts]
            assert len(steps) == 8
            gaps = [b - a for a, b in zip([0, *steps], steps)]
            assert max(gaps) <= 3, (seq.owner.hex()[:4], steps)
        oracle.check_many([(p, q.generated) for p, q in seqs])
    asyncio.run(main())
