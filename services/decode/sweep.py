"""Checksum sweep: defence in depth against a late write of page data alone (SGLang's `--kv-canary` idea).

The per-step check compares tags only, and prompt bytes are checked once, at verification; a write that lands
later on a prompt page's data but not on its tag would otherwise never be seen. Before each step the sweep
re-computes the CRC-32C of the `budget` prompt pages of the batch that were checked longest ago and compares it
with the checksum verified at admission; a mismatch ends that request alone with DATA_LOSS before the step.

Bound: oldest first, and a page just checked (or just admitted, whose pages verification just checked) goes
behind every page already waiting, so no page is passed over: the sweep runs before every `every`-th step, so
every prompt page of the batch is re-checked at least once every every * ceil(P / budget) steps, P the batch's
prompt pages. That cycle length is exported as a gauge. Sweeping every few steps rather than each one divides
the per-call cost (mostly fixed: ~0.1 ms on the tiny model, where a step is ~5 ms) by `every`.

The last prompt page: decode writes its own tokens' KV into the slots after the prompt in the same page, so the
page's bytes change after admission. Prefill zeroed those slots before it took its checksum, so the sweep
checksums a copy of that page with the slots past the prompt zeroed again: the expected value stays exactly the
checksum verified at admission (no second baseline to take, nothing read before verification), decode's own
writes can never cause a false DATA_LOSS, and every prompt slot, of the last page too, stays covered.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import crc32c
import numpy as np
import torch

from ..common.metrics import SWEEP_CYCLE_STEPS
from ..engine.kv_pool import KVPool
from ..engine.tags import page_checksums

log = logging.getLogger(__name__)

PAGE, SLOTS, CRC, CHECKED, INDEX = range(5)  # columns of PromptRecord.table


@dataclass(eq=False)
class PromptRecord:
    """A running request's prompt pages and the checksums verified at admission. numpy, not torch: the sweep's
    bookkeeping is a few dozen small-array operations per step, each ~1 µs in numpy against ~5 µs in torch."""
    table: np.ndarray  # [n, 5] int64: physical page, prompt slots in it, CRC-32C, step last checked, page index

    @classmethod
    def of(cls, leases: list[tuple[int, int]], num_prompt_tokens: int, page_size: int,
           checksums: list[int]) -> "PromptRecord":
        n = len(checksums)
        t = np.empty((n, 5), dtype=np.int64)
        t[:, PAGE] = [p for p, _ in leases[:n]]
        t[:, SLOTS] = page_size
        t[n - 1, SLOTS] = num_prompt_tokens - (n - 1) * page_size
        t[:, CRC] = checksums
        t[:, CHECKED] = 0
        t[:, INDEX] = np.arange(n)
        return cls(t)


def prompt_checksums(pool: KVPool, pages: list[int], slots: list[int]) -> list[int]:
    """CRC-32C of each page as prefill checksummed it: token slots from slots[i] on read as zeros."""
    ps = pool.page_size
    partial = [i for i, n in enumerate(slots) if n < ps]
    if not partial:
        return page_checksums(pool.kv, pages)
    full = [i for i, n in enumerate(slots) if n >= ps]
    out = [0] * len(pages)
    for i, crc in zip(full, page_checksums(pool.kv, [pages[i] for i in full])):
        out[i] = crc
    # at most one partial page per request: a host copy of it (one memcpy of page_nbytes) with the slots after
    # the prompt zeroed in every layer's K and V block, as prefill checksummed it; the pool is never written
    blocks = pool.layout.num_layers * 2
    for i in partial:
        page = pool.kv[pages[i]].view(torch.uint8)
        if page.device.type != "cpu":
            page = page.cpu()
        buf = page.numpy().reshape(blocks, ps, -1).copy()  # [layers x (K, V), page_size, slot bytes]
        buf[:, slots[i]:] = 0
        out[i] = crc32c.crc32c(buf)
    return out


@dataclass(slots=True)
class Mismatch:
    index: int          # position of the sequence in the batch
    page_index: int     # prompt page number within the request
    page: int           # physical page
    actual: int
    expected: int


class ChecksumSweep:
    def __init__(self, pool: KVPool, budget: int, every: int = 1):
        if budget < 0 or every < 1:
            raise ValueError(f"--checksum-sweep-pages must be >= 0 and --checksum-sweep-every >= 1, got {budget} "
                             f"and {every}")
        self.pool = pool
        self.budget = budget
        self.every = every
        self.step = 0
        SWEEP_CYCLE_STEPS.set(0)

    def admit(self, record: PromptRecord | None) -> None:
        """Verification just checked these pages: they wait behind every page already in the sweep."""
        if record is not None:
            record.table[:, CHECKED] = self.step

    def __call__(self, records: list[PromptRecord | None]) -> list[Mismatch]:
        """Checks the `budget` oldest prompt pages of the batch; records[i] belongs to the batch's sequence i."""
        self.step += 1
        if self.step % self.every:  # the steps in between do no sweep work at all
            return []
        present = [i for i, r in enumerate(records) if r is not None]
        if self.budget == 0 or not present:
            SWEEP_CYCLE_STEPS.set(0)
            return []
        tables = [records[i].table for i in present]
        counts = [len(t) for t in tables]
        SWEEP_CYCLE_STEPS.set(self.every * math.ceil(sum(counts) / self.budget))
        flat = np.concatenate(tables)
        pick = np.argsort(flat[:, CHECKED], kind="stable")[: self.budget]
        chosen = flat[pick]
        owner = np.repeat(np.arange(len(tables)), counts)[pick].tolist()
        index = chosen[:, INDEX].tolist()
        actual = prompt_checksums(self.pool, chosen[:, PAGE].tolist(), chosen[:, SLOTS].tolist())
        # the stamp goes back into each sequence's own table (flat is a copy): at most `budget` writes
        for o, i in zip(owner, index):
            tables[o][i, CHECKED] = self.step
        expected = chosen[:, CRC].tolist()
        return [Mismatch(present[owner[j]], index[j], int(chosen[j, PAGE]), actual[j], expected[j])
                for j in range(len(actual)) if actual[j] != expected[j]]


__all__ = ["ChecksumSweep", "Mismatch", "PromptRecord", "prompt_checksums"]
