"""Checksum sweep: defence in depth against a late write of page data alone (SGLang's `--kv-canary` idea).

The per-step check compares tags only, and prompt bytes are checked once, at verification; a write that lands
later on a prompt page's data but not on its tag would otherwise never be seen. Before each step the sweep
re-computes the CRC-32C of the `budget` prompt pages of the batch that were checked longest ago and compares it
with the checksum verified at admission; a mismatch ends that request alone with DATA_LOSS before the step.

Bound: oldest first, and a page just checked (or just admitted, whose pages verification just checked) goes
behind every page already waiting, so no page is passed over: every prompt page of the batch is re-checked at
least once every ceil(P / budget) steps, P the batch's prompt pages. That cycle length is exported as a gauge.

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

import torch

from ..common.metrics import SWEEP_CYCLE_STEPS
from ..engine.kv_pool import KVPool
from ..engine.tags import page_checksums

log = logging.getLogger(__name__)

PAGE, SLOTS, CRC, CHECKED, INDEX = range(5)  # columns of PromptRecord.table


@dataclass(eq=False)
class PromptRecord:
    """A running request's prompt pages and the checksums verified at admission."""
    table: torch.Tensor  # [n, 5] int64: physical page, prompt slots in it, CRC-32C, step last checked, page index

    @classmethod
    def of(cls, leases: list[tuple[int, int]], num_prompt_tokens: int, page_size: int,
           checksums: list[int]) -> "PromptRecord":
        n = len(checksums)
        t = torch.empty((n, 5), dtype=torch.int64)
        t[:, PAGE] = torch.tensor([p for p, _ in leases[:n]], dtype=torch.int64)
        t[:, SLOTS] = page_size
        t[n - 1, SLOTS] = num_prompt_tokens - (n - 1) * page_size
        t[:, CRC] = torch.tensor(checksums, dtype=torch.int64)
        t[:, CHECKED] = 0
        t[:, INDEX] = torch.arange(n)
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
    copies = pool.kv[torch.tensor([pages[i] for i in partial], device=pool.kv.device)].cpu()
    # copies: [k, layers, 2, page_size, kv_heads, head_dim]; mask the slots decode may have written
    keep = torch.tensor([slots[i] for i in partial])
    past = torch.arange(ps)[None, :] >= keep[:, None]  # [k, page_size]
    copies.masked_fill_(past[:, None, None, :, None, None], 0)
    for j, crc in enumerate(page_checksums(copies, list(range(len(partial))))):
        out[partial[j]] = crc
    return out


@dataclass(slots=True)
class Mismatch:
    index: int          # position of the sequence in the batch
    page_index: int     # prompt page number within the request
    page: int           # physical page
    actual: int
    expected: int


class ChecksumSweep:
    def __init__(self, pool: KVPool, budget: int):
        if budget < 0:
            raise ValueError(f"--checksum-sweep-pages must be >= 0, got {budget}")
        self.pool = pool
        self.budget = budget
        self.step = 0
        SWEEP_CYCLE_STEPS.set(0)

    def admit(self, record: PromptRecord | None) -> None:
        """Verification just checked these pages: they wait behind every page already in the sweep."""
        if record is not None:
            record.table[:, CHECKED] = self.step

    def __call__(self, records: list[PromptRecord | None]) -> list[Mismatch]:
        """Checks the `budget` oldest prompt pages of the batch; records[i] belongs to the batch's sequence i."""
        self.step += 1
        present = [i for i, r in enumerate(records) if r is not None]
        if self.budget == 0 or not present:
            SWEEP_CYCLE_STEPS.set(0)
            return []
        tables = [records[i].table for i in present]
        counts = torch.tensor([len(t) for t in tables])
        SWEEP_CYCLE_STEPS.set(math.ceil(int(counts.sum()) / self.budget))
        flat = torch.cat(tables)
        pick = torch.argsort(flat[:, CHECKED], stable=True)[: self.budget]
        chosen = flat[pick]
        owner = torch.repeat_interleave(torch.arange(len(tables)), counts)[pick].tolist()
        actual = prompt_checksums(self.pool, chosen[:, PAGE].tolist(), chosen[:, SLOTS].tolist())
        # the stamp goes back into each sequence's own table (flat is a copy): at most `budget` writes
        for j, o in enumerate(owner):
            tables[o][int(chosen[j, INDEX]), CHECKED] = self.step
        bad = (torch.tensor(actual, dtype=torch.int64) != chosen[:, CRC]).nonzero().flatten().tolist()
        return [Mismatch(present[owner[j]], int(chosen[j, INDEX]), int(chosen[j, PAGE]), actual[j],
                         int(chosen[j, CRC])) for j in bad]


__all__ = ["ChecksumSweep", "Mismatch", "PromptRecord", "prompt_checksums"]
