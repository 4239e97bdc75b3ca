"""One election candidate in its own process, so a test can SIGSTOP it: `python election_candidate.py ENDPOINTS KEY
IDENTITY TTL MARGIN`. Every 10 ms it prints one JSON line of what it sees (its monotonic clock, authorised(), its
state); on its first line after a stop that shows it lost its term, it also tries a fenced write and prints the
error. SIGTERM resigns and exits."""
from __future__ import annotations

import asyncio
import json
import signal
import sys
import time

from pdserve.broker.election import Election, NotLeaderError, connect


async def main(endpoints: str, key: str, identity: str, ttl: int, margin: float) -> None:
    election = Election(connect(endpoints.split(",")), key.encode(), identity, f"{identity}:1", ttl, margin)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    election.start()
    led = False
    while not stop.is_set():
        now = time.monotonic()
        authorised = election.authorised()
        s = election.state()
        line = {"t": now, "authorised": authorised, "is_leader": s.is_leader, "term": s.term,
                "leader_term": s.leader.term if s.leader else 0, "until": s.authority_until}
        led = led or authorised
        if led and not authorised and s.leader and s.leader.identity != identity:
            tx = election.client.transactions
            try:
                await election.fenced_txn(success=[tx.put(b"/fenced", identity.encode())])
                line["fenced"] = "applied"
            except NotLeaderError as e:
                line["fenced"] = str(e)
            led = False
        print(json.dumps(line), flush=True)
        with_timeout = asyncio.wait_for(stop.wait(), 0.01)
        try:
            await with_timeout
        except asyncio.TimeoutError:
            pass
    await election.stop()
    await election.client.close()


if __name__ == "__main__":
    a = sys.argv[1:]
    asyncio.run(main(a[0], a[1], a[2], int(a[3]), float(a[4])))
