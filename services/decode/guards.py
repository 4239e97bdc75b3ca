"""The checks the scheduler runs on a batch before every step (an object the scheduler composes): the tags of
every page the step reads against the leases, and the rotating checksum sweep of prompt pages. Each drops the
sequences that fail, ending them alone with DATA_LOSS through the scheduler's `end`; nothing computed from a
suspect page is ever sent."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import grpc

from ..common.errors import PdError
from ..common.metrics import GUARD_SECONDS, count_violation
from . import faults
from .sweep import ChecksumSweep
from .verify import StepExpectation

if TYPE_CHECKING:
    from ..engine.kv_pool import KVPool
    from .sequence import Sequence

log = logging.getLogger(__name__)


class StepGuards:
    def __init__(self, pool: KVPool | None, sweep: ChecksumSweep, end: Callable[[Sequence, PdError], None]):
        self.pool, self.sweep, self.end = pool, sweep, end
        self.expectation = StepExpectation()
        self._tag_seconds = GUARD_SECONDS.labels("step_tag_check")
        self._sweep_seconds = GUARD_SECONDS.labels("checksum_sweep")

    def check(self, batch: list[Sequence], tables: list[list[int]]) -> tuple[list[Sequence], list[list[int]]]:
        """The per-step guard over exactly the page tables the step will read; drops failing sequences."""
        with self._tag_seconds.time():
            # tags live on the host even when pages are on a GPU: a numpy view of the registered region
            bad = self.expectation.mismatches(self.pool.tags.numpy(), batch, [len(t) for t in tables])
        for i in bad:
            seq = batch[i]
            count_violation("decode", "STEP_TAG_MISMATCH", seq.owner)
            log.error("request %s: a page's tag no longer matches its lease before step %d; failing it",
                      seq.owner.hex(), len(seq.generated))
            self.end(seq, PdError(grpc.StatusCode.DATA_LOSS, "STEP_TAG_MISMATCH",
                                   "a KV page of this request was overwritten under its lease"))
        return _without(batch, tables, set(bad))

    def sweep_pages(self, batch: list[Sequence], tables: list[list[int]]) -> tuple[list[Sequence], list[list[int]]]:
        """Re-checksums the oldest-checked prompt pages of the batch (sweep.py); drops failing sequences."""
        faults.rogue_data_write(self.pool, batch)
        with self._sweep_seconds.time():
            bad = self.sweep([s.prompt for s in batch])
        for m in bad:
            seq = batch[m.index]
            count_violation("decode", "PROMPT_PAGE_CHANGED", seq.owner)
            log.error("request %s: prompt page %d (physical page %d) has CRC-32C %#010x, verified %#010x, before "
                      "step %d; failing it", seq.owner.hex(), m.page_index, m.page, m.actual, m.expected,
                      len(seq.generated))
            self.end(seq, PdError(grpc.StatusCode.DATA_LOSS, "PROMPT_PAGE_CHANGED",
                                   f"prompt page {m.page_index} (physical page {m.page}) was overwritten after "
                                   f"verification: CRC-32C {m.actual:#010x}, verified {m.expected:#010x}"))
        return _without(batch, tables, {m.index for m in bad})


def _without(batch: list[Sequence], tables: list[list[int]], failed: set[int]
             ) -> tuple[list[Sequence], list[list[int]]]:
    if not failed:
        return batch, tables
    keep = [i for i in range(len(batch)) if i not in failed]
    return [batch[i] for i in keep], [tables[i] for i in keep]
