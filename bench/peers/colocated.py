"""The co-located engine: pdserve's own engine code in one process, no broker, no transfer, no tags.

It is the floor for pdserve's overheads: the same ModelRunner (prefill into a paged pool, batched
decode over page tables), the same sampler and the same page arithmetic as decode, under a plain
continuous-batching loop. Waiting prompts are prefilled first (as most co-located engines do), then
one decode step runs for every running sequence.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pdserve.common.config import pages_needed
from pdserve.engine.page_allocator import PageAllocator
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampler import SamplingParams, sample, sample_one

from ..harness.openloop import GAVE_UP
from ..harness.workload import Record


@dataclass(eq=False)
class _Seq:
    prompt: list[int]
    record: Record
    pages: list[int]
    params: SamplingParams

    @property
    def position(self) -> int:
        return len(self.prompt) + len(self.record.token_ids) - 1


class Colocated:
    def __init__(self, model_dir: str, pool_tokens: int = 32768, page_size: int = 16, max_batch: int = 64,
                 device: str = "cpu"):
        self.runner = ModelRunner(model_dir, pool_tokens // page_size, page_size, device=device)
        self.alloc = PageAllocator(self.runner.pool.num_pages)
        self.max_batch = max_batch
        self.last_split: dict[str, float] = {}

    @property
    def vocab_size(self) -> int:
        return self.runner.config.vocab_size

    def run(self, prompts: list[list[int]], concurrency: int, max_tokens: int) -> tuple[list[Record], float]:
        """Closed loop over `prompts`; returns one Record per prompt and the wall time."""
        return self._serve(prompts, None, min(concurrency, len(prompts)), max_tokens, None)

    def run_open(self, prompts: list[list[int]], offsets: list[float], max_tokens: int,
                 deadline_s: float) -> tuple[list[Record], float]:
        """Open loop: prompt i arrives `offsets[i]` s after the start whatever else is running. Its client leaves
        `deadline_s` after the arrival without a first token: one still waiting then is dropped (the engine
        aborts it, as a serving engine does on a disconnect), so a pass never starts for a caller gone; one
        whose pass ends after it is given up too (its token reaches no one)."""
        if len(offsets) != len(prompts):
            raise ValueError(f"run_open: {len(offsets)} offsets for {len(prompts)} prompts")
        return self._serve(prompts, offsets, 0, max_tokens, deadline_s)

    def _serve(self, prompts, offsets, first, max_tokens, deadline_s) -> tuple[list[Record], float]:
        ps = self.runner.page_size
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        todo = deque(zip(prompts, offsets or [None] * len(prompts)))
        waiting: deque[_Seq] = deque()
        running: list[_Seq] = []
        records: list[Record] = []
        prefill_s = decode_s = 0.0
        num_steps = num_prefills = 0
        cpu0 = time.process_time()
        start = time.perf_counter()

        def arrive(now: float) -> None:
            prompt, offset = todo.popleft()
            rec = Record(now if offset is None else start + offset)  # open loop: TTFT counts from the schedule
            records.append(rec)
            waiting.append(_Seq(prompt, rec, [], params))

        def finish(seq: _Seq, now: float) -> None:
            self.alloc.deallocate(seq.pages)
            if offsets is None and todo:
                arrive(now)

        for _ in range(first):
            arrive(start)
        while todo or waiting or running:
            now = time.perf_counter()
            while offsets is not None and todo and start + todo[0][1] <= now:
                arrive(now)
            if not waiting and not running:
                time.sleep(max(0.0, start + todo[0][1] - now))  # idle until the next scheduled arrival
                continue
            while waiting and len(running) < self.max_batch:
                seq = waiting[0]
                if deadline_s is not None and time.perf_counter() - seq.record.arrival > deadline_s:
                    waiting.popleft().record.error = GAVE_UP
                    continue
                need = pages_needed(len(seq.prompt), max_tokens, ps)
                if not self.alloc.can_allocate(need):
                    break  # fits in total but not now: it waits for pages, like pdserve's gateway queue
                waiting.popleft()
                seq.pages = self.alloc.allocate(need)
                t = time.perf_counter()
                logits = self.runner.prefill(seq.prompt, seq.pages)
                tok = sample_one(logits[0], params, step=0)
                now = time.perf_counter()
                prefill_s += now - t
                num_prefills += 1
                if deadline_s is not None and now - seq.record.arrival > deadline_s:
                    seq.record.error = GAVE_UP  # its client left during the pass: the token reaches no one
                    self.alloc.deallocate(seq.pages)
                    continue
                seq.record.token_ids.append(tok)
                seq.record.token_times.append(now)
                if max_tokens <= 1:
                    finish(seq, now)
                else:
                    running.append(seq)
            if not running:
                if waiting:
                    raise RuntimeError("a prompt does not fit in the co-located pool")
                continue
            batch = running[: self.max_batch]
            t = time.perf_counter()
            logits = self.runner.decode([s.record.token_ids[-1] for s in batch], [s.position for s in batch],
                                        [s.pages[: s.position // ps + 1] for s in batch])
            toks = sample(logits, [params] * len(batch), [len(s.record.token_ids) for s in batch])
            now = time.perf_counter()
            decode_s += now - t
            num_steps += 1
            done = []
            for seq, tok in zip(batch, toks):
                seq.record.token_ids.append(tok)
                seq.record.token_times.append(now)
                if len(seq.record.token_ids) >= max_tokens:
                    done.append(seq)
            for seq in done:
                running.remove(seq)
                finish(seq, now)
        wall = time.perf_counter() - start
        self.last_split = {"prefill_s": prefill_s, "decode_s": decode_s, "steps": num_steps, "prefills": num_prefills,
                           "cpu_s": time.process_time() - cpu0}
        return records, wall
