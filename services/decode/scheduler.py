"""Continuous batching: requests join and leave the running batch at every step.

Before every step the tags of every page the batch will read are compared with the leases; a
mismatch ends that request alone (DATA_LOSS) and nothing computed from the page is sent. Then the checksum
sweep (sweep.py) re-checks the bytes of some of the batch's prompt pages, in rotation. A request leaves the
batch only between steps, so its pages are never released while a step still uses them; a request whose own
sampling fails ends alone (INTERNAL, SAMPLING_FAILED) while the rest of the step gets its tokens.

Every running sequence makes progress: past --max-batch, each step takes the sequences stepped longest ago
(the batch rotates), so none waits more than ceil(running / max_batch) steps between two tokens.

A step runs in a worker thread and writes each sequence's new K/V into its pages; it may stall (a long
batch, a paused thread) while the event loop goes on. Its owners stay in `stepping` until it returns, and
decode's KeepAlive lists them: the broker frees a revoked owner's pages only after a KeepAlive that no
longer names it, so no page is re-granted while a step that may write it can still run.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import grpc
import torch

from ..common.errors import PdError
from ..common.tasks import spawn
from ..common.metrics import FORWARD_SECONDS, SAMPLING_FAILURES, TIMEOUTS
from ..engine.grammar import fill
from ..engine.runner import DecodeInputs, ModelRunner
from ..engine.sampler import SamplingError, TokenLogprobs, advance, logprobs, sample
from ..engine.tags import make_tag
from . import faults
from .growth import Growth
from .guards import StepGuards
from .requests import RequestTable
from .sequence import Sequence, raise_if_ended
from .sweep import ChecksumSweep

__all__ = ["Scheduler", "Sequence", "raise_if_ended"]

log = logging.getLogger(__name__)


class Scheduler:
    """Steps the running requests of the request table (requests.py), which owns their state: a request joins
    (being verified or sending its first token, never stepped), then runs. A revocation, Release or broker restart
    finds it in either state; it only marks the sequence, which ends here between steps (or, while joining, when
    Decode next looks), so pages are never released while a step may still use them."""

    def __init__(self, runner: ModelRunner, release: Callable[[Sequence], Awaitable[None]], max_batch: int = 64,
                 sweep_pages: int = 8, blind: Callable[[], PdError | None] = lambda: None, sweep_every: int = 1,
                 requests: RequestTable | None = None, growth: Growth | None = None):
        """requests: the table this loop steps (its own when None); growth: pages on demand (growth.py), built on
        the same table's marks (None: every page was leased up front)."""
        self.runner = runner
        self.blind = blind  # an error while decode cannot trust its revocation stream: then nothing steps
        self.release = release
        self.max_batch = max_batch
        self.requests = RequestTable() if requests is None else requests
        self.growth = growth
        self.sweep = ChecksumSweep(getattr(runner, "pool", None), sweep_pages, sweep_every)
        self.guards = StepGuards(getattr(runner, "pool", None), self.sweep, self._end)
        self._admitted = 0
        self._idle = asyncio.Event()  # set while no step is in flight
        self._idle.set()

    @property
    def joining(self):
        return self.requests.joining

    @property
    def running(self):  # in the order they are next stepped (the batch rotates)
        return self.requests.running

    @property
    def stepping(self) -> frozenset[bytes]:
        return self.requests.stepping

    def holds(self, owner: bytes) -> bool:
        """Whether a step may read or write the owner's pages now or later: its pages are not to be released."""
        return owner in self.running or owner in self.joining or owner in self.stepping

    async def step_ended(self) -> None:
        """Returns once no step is in flight (at once when none is)."""
        await self._idle.wait()

    def join(self, seq: Sequence) -> None:
        self.requests.join(seq)

    def leave(self, owner: bytes) -> None:
        """A joining request that never started: its caller gives the pages back."""
        self.requests.leave(owner)

    def add(self, seq: Sequence) -> None:
        """Starts stepping a sequence; raises if it was revoked, released or failed while joining (the caller
        must not await between its last look at the sequence and this call)."""
        if self.requests.state(seq.owner) is None:  # added without joining first: it joins and starts at once
            self.requests.join(seq)
        err = self.blind()
        if seq.err is not None or seq.cancelled or err is not None:
            self.requests.leave(seq.owner)  # it never runs: its caller gives the pages back
            raise_if_ended(seq)
            raise err
        self.sweep.admit(seq.prompt)
        self._admitted += 1
        seq.admitted = self._admitted
        self.requests.start(seq)

    # marks: the request table's (a sequence marked ends here between steps)
    def mark(self, seq: Sequence, err: PdError) -> None:
        self.requests.mark(seq, err)

    def wake(self) -> None:
        self.requests.wake()

    def cancel(self, owner: bytes) -> None:
        self.requests.cancel(owner)

    def revoke(self, owner: bytes, err: PdError) -> None:
        self.requests.revoke(owner, err)

    def fail(self, owner: bytes, err: PdError) -> None:
        self.requests.fail(owner, err)

    def fail_all(self, err: PdError) -> None:
        self.requests.fail_all(err)

    def _stop_if_blind(self) -> bool:
        """Fails everything that runs or joins when decode may have missed a revocation: the pages may be
        freed (and re-granted) lock_delay after it, so no further step may read or write them."""
        if (err := self.blind()) is None:
            return False
        if self.running or self.joining:
            log.error("%s: failing %d running and %d joining requests", err.message, len(self.running),
                      len(self.joining))
            TIMEOUTS.labels("watch_blind").inc()
        self.fail_all(err)
        for seq in list(self.running.values()):
            self._end(seq, seq.err)
        return True

    def _end(self, seq: Sequence, err: PdError | None) -> None:
        if seq.done:
            return
        seq.done = True
        self.requests.finish(seq.owner)
        if self.growth is not None:
            self.growth.forget(seq.owner)
        if err is not None:
            seq.events.put_nowait(err)
        spawn(self.release(seq))

    def _stamp_own_pages(self, seq: Sequence) -> None:
        # pages decode writes itself get tags too, so the per-step check covers them
        ps = self.runner.page_size
        pos = seq.position
        i = pos // ps
        if pos % ps == 0 and pos >= seq.num_prompt_tokens:
            page, gen = seq.leases[i]
            self.runner.pool.tags[page] = torch.tensor(make_tag(seq.owner, seq.epoch, gen, i, 0, 0))

    def _ready(self) -> list[Sequence]:
        """The running sequences whose next step writes a page already leased to them, in stepping order."""
        if self.growth is not None:
            self.growth.plan(self.running.values())
        ps = self.runner.page_size
        return [s for s in self.running.values() if not s.cancelled and s.has_page_for_next_step(ps)]

    def _next_batch(self, ready: list[Sequence]) -> list[Sequence]:
        """The max_batch ready sequences stepped longest ago; they move to the back of the order."""
        if len(ready) <= self.max_batch:
            return ready
        batch = ready[: self.max_batch]
        self.requests.rotate(batch)
        return batch

    def _step(self, batch: list[Sequence], inputs: DecodeInputs
              ) -> list[tuple[int | SamplingError, TokenLogprobs | None]]:
        """One forward step (its inputs prepared on the event loop) and its sampling, in the worker thread (on a GPU,
        sampling is what waits)."""
        faults.stall_step()
        with FORWARD_SECONDS.labels("decode").time():
            logits = self.runner.run_decode(inputs)
        # structured output: the constrained rows' masks, after the forward pass is launched (on a GPU it runs
        # meanwhile; on the CPU a thread of their own measured no faster)
        grammars = {i: s.grammar for i, s in enumerate(batch) if s.grammar is not None}
        masks = fill(list(grammars.values()), logits.shape[-1]) if grammars else None
        tokens = sample(logits, [s.sampling for s in batch], [len(s.generated) for s in batch],
                        [s.prompt_token_ids for s in batch], [s.generated for s in batch],
                        dict(zip(grammars, masks)) if grammars else None, batch[0].eos_token_ids)
        advance(grammars, tokens)
        lps: list[TokenLogprobs | None] = [None] * len(batch)
        rows = [i for i, (s, t) in enumerate(zip(batch, tokens))
                if s.sampling.logprobs is not None and not isinstance(t, SamplingError)]
        if rows:
            for i, lp in zip(rows, logprobs(logits[rows], [tokens[i] for i in rows],
                                            [batch[i].sampling.logprobs for i in rows])):
                lps[i] = lp
        return list(zip(tokens, lps))

    async def run(self) -> None:
        while True:
            for seq in [s for s in self.running.values() if s.cancelled]:
                self._end(seq, seq.err)
            if not self.running:
                await self.requests.woken()
                continue
            if self._stop_if_blind():
                continue
            ready = self._ready()
            if not ready:  # every running sequence waits for growth pages, or was just marked (ends next round)
                if not any(s.cancelled for s in self.running.values()):
                    # growth's reply wakes it; the timeout lets the preemption policy look again
                    await self.requests.woken(0.1)
                continue
            batch = self._next_batch(ready)
            try:
                for seq in batch:
                    self._stamp_own_pages(seq)
                faults.corrupt_tag(self.runner.pool, batch)
                ps = self.runner.page_size
                batch, tables = self.guards.check(batch, [s.pages[: s.position // ps + 1] for s in batch])
                batch, tables = self.guards.sweep_pages(batch, tables)
                if not batch:
                    continue
                inputs = self.runner.prepare_decode([s.generated[-1] for s in batch], [s.position for s in batch],
                                                    tables)
                self.requests.step_began(frozenset(s.owner for s in batch))
                self._idle.clear()
                try:
                    tokens = await asyncio.to_thread(self._step, batch, inputs)
                finally:
                    self.requests.step_ended()
                    self._idle.set()
            except Exception as e:  # a failed step fails its batch, never the loop
                log.exception("decode step failed")
                for seq in batch:
                    self._end(seq, PdError(grpc.StatusCode.INTERNAL, "STEP_FAILED", str(e)))
                continue
            if self._stop_if_blind():  # went blind during the step: its tokens are not sent
                continue
            for seq, (tok, lp) in zip(batch, tokens):
                if seq.done or seq.cancelled:
                    continue
                if isinstance(tok, SamplingError):
                    SAMPLING_FAILURES.inc()
                    log.error("request %s: sampling failed at step %d: %s", seq.owner.hex(), len(seq.generated), tok)
                    self._end(seq, PdError(grpc.StatusCode.INTERNAL, "SAMPLING_FAILED", str(tok)))
                    continue
                seq.generated.append(tok)
                finished = seq.is_finished()
                seq.events.put_nowait((tok, finished, lp))
                if finished:
                    self._end(seq, None)
