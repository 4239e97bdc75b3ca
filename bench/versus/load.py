"""The one client every system is measured with (harness/httpload.py's streaming `/v1/completions` connection),
as a closed loop that stops by the protocol's rule and as an open loop on a Poisson schedule, with the CPU of the
system's process groups, of this client and of the whole machine sampled through the cell, so that the
steady-state window's CPU is read at its own boundaries.
"""
from __future__ import annotations

import asyncio
import bisect
import os
import threading
import time

from ..harness.httpload import HttpError, _Conn, completion_body, read_completion
from ..harness.workload import Record
from ..peers.vllm_peer import group_stats
from . import protocol

_TICK = os.sysconf("SC_CLK_TCK")
SAMPLE_S = 0.2
_ERRORS = (HttpError, OSError, ValueError, asyncio.TimeoutError, asyncio.IncompleteReadError)


def machine_seconds() -> tuple[float, float]:
    """(task, interrupt) CPU seconds every core has spent since boot (/proc/stat): user, nice, system and steal,
    then irq and softirq, which no process is charged with (loopback TCP's receive path runs there)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + steal) / _TICK, (irq + softirq) / _TICK


def pids_cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / _TICK
        except (OSError, ValueError, IndexError):
            continue  # a process gone since the cell began: its last seconds are lost, not invented
    return total


class CpuSampler:
    """(clock, system CPU s, client CPU s, machine task s, machine irq s) every SAMPLE_S on its own thread, read
    at any instant by linear interpolation: `with CpuSampler(pgids) as s: ...; s.cores_between(t0, t1)`."""

    def __init__(self, pgids: list[int]):
        self.pids = [pid for pid, _ in group_stats(pgids)]  # found once: a scan of /proc per sample would cost the client a core share
        self.samples: list[tuple[float, float, float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _take(self) -> None:
        m, i = machine_seconds()
        self.samples.append((time.perf_counter(), pids_cpu_seconds(self.pids), time.process_time(), m, i))

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._take()

    def __enter__(self):
        self._take()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._take()
        return False

    def at(self, t: float) -> tuple[float, float, float, float]:
        ts = [s[0] for s in self.samples]
        k = min(max(bisect.bisect_left(ts, t), 1), len(ts) - 1)
        (t0, *a), (t1, *b) = self.samples[k - 1], self.samples[k]
        w = 0.0 if t1 == t0 else min(max((t - t0) / (t1 - t0), 0.0), 1.0)
        return tuple(x + (y - x) * w for x, y in zip(a, b))

    def between(self, start: float, end: float) -> dict:
        """CPU seconds of the system, the client and the rest of the machine over [start, end], and in cores."""
        a, b = self.at(start), self.at(end)
        system, client, machine, irq = (y - x for x, y in zip(a, b))
        dt = end - start
        other = max(0.0, machine - system - client)
        return {"system_cpu_s": system, "client_cpu_s": client, "other_cpu_s": other,
                "other_cores": other / dt if dt > 0 else float("nan"),
                "irq_cores": irq / dt if dt > 0 else float("nan")}


def _split(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").rstrip("/").rpartition(":")
    return host, int(port)


async def _one(conn: _Conn, rec: Record, body: bytes, max_tokens: int, timeout: float) -> None:
    try:
        await asyncio.wait_for(read_completion(conn, rec, body), timeout)
    except _ERRORS as e:
        rec.error = f"{type(e).__name__}: {e}"[:300]
        await conn.close()  # the stream's state is unknown: the next request on it opens a fresh connection
    if rec.error is None and len(rec.token_ids) != max_tokens:
        rec.error = f"{len(rec.token_ids)} token ids streamed, {max_tokens} asked for"


async def _closed(url, model, prompts, concurrency, max_tokens, extra, timeout) -> list[Record]:
    host, port = _split(url)
    records: list[Record] = []
    conns = [_Conn(host, port) for _ in range(concurrency)]
    for c in conns:  # connected before the clock starts
        await c.open()
    start = time.perf_counter()

    async def client(conn: _Conn) -> None:
        while protocol.keep_sending(len(records), time.perf_counter() - start, concurrency):
            if len(records) >= len(prompts):
                raise RuntimeError(f"closed loop ran out of its {len(prompts)} prompts")
            i = len(records)
            rec = Record(time.perf_counter())
            records.append(rec)
            await _one(conn, rec, completion_body(model, prompts[i], max_tokens, extra), max_tokens, timeout)

    try:
        await asyncio.gather(*(client(c) for c in conns))
    finally:
        for c in conns:
            await c.close()
    return records


# an open loop's pooled connection idle this long is opened again before its next send: both servers (uvicorn) close
# a keep-alive connection idle for 5 s, and a request written into one the server is closing is lost before its
# status line (a loopback connect, counted in that request's TTFT, costs both systems the same ~0.1 ms)
STALE_AFTER_S = 4.0


async def _open(url, model, prompts, offsets, concurrency, max_tokens, extra, timeout) -> list[Record]:
    host, port = _split(url)
    idle = [_Conn(host, port) for _ in range(2 * concurrency)]
    for c in idle:  # a pool opened before the clock; a request finding none idle opens one (counted in its TTFT)
        await c.open()
    everyone = list(idle)
    last_used: dict[_Conn, float] = {}
    records = [Record(0.0) for _ in prompts]
    start = time.perf_counter()

    async def request(i: int) -> None:
        records[i].arrival = start + offsets[i]
        await asyncio.sleep(max(0.0, records[i].arrival - time.perf_counter()))
        conn = idle.pop() if idle else _Conn(host, port)
        if conn not in everyone:
            everyone.append(conn)
        if time.perf_counter() - last_used.get(conn, start) > STALE_AFTER_S:
            await conn.close()  # the server may have closed it (uvicorn: 5 s idle); the send opens a fresh one
        # TTFT counts from the scheduled send: a late send is the client's or the system's delay, never a pause
        await _one(conn, records[i], completion_body(model, prompts[i], max_tokens, extra), max_tokens, timeout)
        last_used[conn] = time.perf_counter()
        idle.append(conn)

    try:
        await asyncio.gather(*(request(i) for i in range(len(prompts))))
    finally:
        for c in everyone:
            await c.close()
    return records


def closed_loop(url: str, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
                extra: dict | None, timeout: float = 600.0) -> list[Record]:
    """`concurrency` clients, each sending its next prompt when its last stream ends, while the protocol's
    rule says so; records in send order (prompt i is record i)."""
    return asyncio.run(_closed(url, model, prompts, concurrency, max_tokens, extra, timeout))


def open_loop(url: str, model: str, prompts: list[list[int]], offsets: list[float], concurrency: int,
              max_tokens: int, extra: dict | None, timeout: float = 600.0) -> list[Record]:
    """Prompt i sent at offsets[i] after the start whatever came before; records in prompt order."""
    if len(offsets) != len(prompts):
        raise ValueError(f"open_loop: {len(offsets)} send times for {len(prompts)} prompts")
    return asyncio.run(_open(url, model, prompts, offsets, concurrency, max_tokens, extra, timeout))
