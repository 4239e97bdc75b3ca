"""Decode's fault points, all in one place: the test-only injections the fault tests and the chaos suite
(tests/chaos) arm through the common registry (common/faults.py). Unarmed, each costs one look at the registry's
switch; armed, each does to decode's own memory or calls what the fault it is named for would do, so the guards
that must catch it are the production ones.

  decode.corrupt_cached   a stray write, a foreign tag, a stale generation or a late write on a cached page
                          shared with a request, before decode checks it (arg: one of CORRUPTIONS)
  decode.fail_release     the Release RPC fails (the broker's reconciliation must end the leases)
  decode.stall_step       the step thread stalls (arg: milliseconds, 1000 when empty) while the event loop goes on
  decode.corrupt_tag      a page tag of the batch's first request changes before the step (arg: its page index)
  decode.rogue_data_write a late write of data alone on a prompt page of a request not yet stepped (arg: index)
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import grpc
import torch

from ..common.errors import PdError
from ..common.faults import FAULTS
from ..engine.tags import CHAIN, EPOCH, GENERATION, OWNER_LO, PAGE_INDEX

if TYPE_CHECKING:
    from ..engine.kv_pool import KVPool
    from .sequence import Sequence

CORRUPTIONS = ("bit_flip", "foreign_tag", "stale_generation", "late_write")


def corrupt_cached(pool: KVPool, owner: bytes, shared: list[tuple[int, int]], others: set[int]) -> None:
    """decode.corrupt_cached, on the first of these shared pages that no other request here reads (it stays armed
    while every one is read). What it models can land only on a page nobody holds: the quarantine keeps every late
    write off a page until it is granted again."""
    if not FAULTS.enabled:
        return
    page = next((p for p, _ in shared if p not in others), None)
    if page is not None and (how := FAULTS.fire("decode.corrupt_cached", owner)) is not None:
        corrupt_in_place(pool, page, how)


def corrupt_in_place(pool: KVPool, page: int, how: str) -> None:
    """What a stray write, a foreign tag or a stale lease would leave on a cached page, done to the pool's own
    memory."""
    how = how or "bit_flip"
    if how == "bit_flip":
        pool.kv[page].view(torch.uint8).view(-1)[123] ^= 0x10
    elif how == "foreign_tag":  # a whole valid-looking tag of another request, with another chain
        pool.tags[page, :PAGE_INDEX] = torch.tensor([0x0BAD, 0x0BAD, int(pool.tags[page, EPOCH]),
                                                     int(pool.tags[page, GENERATION])], dtype=torch.int64)
        pool.tags[page, CHAIN] ^= 0x5A5A
    elif how == "stale_generation":
        pool.tags[page, GENERATION] -= 1
    elif how == "late_write":
        other = (page + 1) % pool.num_pages
        pool.kv[page].copy_(pool.kv[other] + 1)
    else:
        raise ValueError(f"decode.corrupt_cached: {how!r} is not one of {CORRUPTIONS}")


def fail_release(owner: bytes) -> None:
    """decode.fail_release: the Release RPC fails as an unreachable broker's would."""
    if FAULTS.fire("decode.fail_release", owner) is not None:
        raise PdError(grpc.StatusCode.UNAVAILABLE, "FAULT", "fault point decode.fail_release")


def stall_step() -> None:
    """decode.stall_step, in the step's worker thread: a stalled step thread, the event loop going on meanwhile."""
    if (arg := FAULTS.fire("decode.stall_step")) is not None:
        time.sleep(float(arg or 1000) / 1000)


def corrupt_tag(pool: KVPool, batch: list[Sequence]) -> None:
    """decode.corrupt_tag: a page tag of the batch's first request changes before the per-step check."""
    if (arg := FAULTS.fire("decode.corrupt_tag", batch[0].owner)) is not None:
        pool.tags[batch[0].pages[int(arg or 0)], OWNER_LO] ^= 1


def rogue_data_write(pool: KVPool, batch: list[Sequence]) -> None:
    """decode.rogue_data_write: bytes of one prompt page of the newest request change, its tag does not. Fires only
    on a request not yet stepped (the newest joins last), so a test knows the write came before its first step."""
    if batch and len(batch[-1].generated) == 1:
        if (arg := FAULTS.fire("decode.rogue_data_write", batch[-1].owner)) is not None:
            pool.kv[batch[-1].pages[int(arg or 0)], :, :, 0] = 0.5


__all__ = ["CORRUPTIONS", "corrupt_cached", "corrupt_in_place", "corrupt_tag", "fail_release", "rogue_data_write",
           "stall_step"]
