"""One WatchRevocations stream: replay from the watcher's cursor, then live revocations and heartbeats.
Everything is read from the pool's revocation log by cursor, never taken off a queue, so a message that
was sent into a dead stream is not lost: the watcher resumes from the last seq it processed."""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable

import grpc

from ..common.errors import PdError
from ..common.faults import FAULTS
from ..common.proto import broker_pb2, common_pb2
from .lease_table import LeaseTable

log = logging.getLogger(__name__)


def _pb(event, term: int) -> broker_pb2.Revocation:
    msg = broker_pb2.Revocation(owner=event.owner, epoch=event.epoch, reason=event.reason, seq=event.seq, term=term)
    if event.written is not None:
        leases, num_tokens, checksums, first_token, digest = event.written
        msg.write_done, msg.first_token, msg.prompt_digest = True, first_token, digest
        msg.leases.extend(common_pb2.PageLease(page=p, generation=g) for p, g in leases)
        msg.coverage.num_tokens, msg.coverage.num_pages = num_tokens, len(checksums)
        msg.coverage.checksums.extend(checksums)
    return msg


async def revocation_stream(table: LeaseTable, pool_id: str, after_seq: int, wake: asyncio.Event,
                            heartbeat_s: float, authorise: Callable[[], int] = lambda: 0
                            ) -> AsyncIterator[broker_pb2.Revocation]:
    """`wake` is set whenever the pool's log may have grown. A heartbeat follows the replay at once (the
    watcher learns the stream is up and whether it missed revocations), then whenever heartbeat_s passed
    without a message. `authorise` gives the term each message carries, checked before it goes (a heartbeat
    tells decode its leases still stand); it raises once this replica may no longer answer, ending the stream."""
    loop = asyncio.get_running_loop()
    cursor, sent_at, first = after_seq, 0.0, True
    while True:
        if FAULTS.fire("broker.cut_watch") is not None:
            raise PdError(grpc.StatusCode.UNAVAILABLE, "FAULT_STREAM_CUT", f"fault point: revocation stream of pool "
                                                                          f"{pool_id} cut after seq {cursor}")
        wake.clear()  # before reading: whatever is appended after this read sets it again
        if pool_id not in table.pool_ids():  # forgotten while watched: the watcher must register anew
            raise PdError(grpc.StatusCode.NOT_FOUND, "POOL_FORGOTTEN", f"pool {pool_id} was fenced and forgotten")
        events, gap, last_seq = table.revocations_since(pool_id, cursor)
        if gap:
            log.warning("watcher of pool %s resumed after seq %s but the log starts later (last seq %s): "
                        "telling it to re-check its leases", pool_id, cursor, last_seq)
        for event in events:
            if event.written is None:
                log.info("revoked owner %s in pool %s (seq %s): %s", event.owner.hex(), pool_id, event.seq,
                         event.reason)
            yield _pb(event, authorise())
        cursor = last_seq  # every seq up to it was just sent (or is the gap just reported)
        if events:
            sent_at = loop.time()
        if first or gap or loop.time() - sent_at >= heartbeat_s:
            yield broker_pb2.Revocation(epoch=table.epoch, seq=cursor, heartbeat=True, gap=gap, term=authorise())
            sent_at, first = loop.time(), False
        try:
            # a timeout scope around the wait, not wait_for: wait_for runs the wait as a task of its own, so a
            # write-done notice that EndWrite appends reached this loop two event-loop turns after the wake
            async with asyncio.timeout_at(sent_at + heartbeat_s):
                await wake.wait()
        except TimeoutError:
            pass
