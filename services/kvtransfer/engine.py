"""Mooncake transfer engine wrapper: register pool regions, post runs of pages, wait for them without spinning.

Only one-sided writes are used: prefill pushes page bytes and then page tags into decode's
registered regions. Contiguous pages are coalesced into one entry (Mooncake moves one large entry
at ~1.1 GB/s on loopback, 64 KiB entries at ~0.7 GB/s).

Mooncake's synchronous batch call busy-polls its batch's status on the calling thread until it ends: a core per
writer spent waiting on the wire, beside the forward pass. Here a call's tasks are posted asynchronously and the
writer looks at them between sleeps that grow from 20 us. The synchronous call's rules are kept, and with them
the landing bound: a call gives up timeout + 1 ns per byte after its post, it is answered at its first failed task
while the others may still run, and giving up flushes nothing. The tasks still running once a call is answered
are kept (Inflight) and looked at until Mooncake says they ended, so Mooncake can free them.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from importlib import metadata

from ..common.faults import FAULTS
from .builds import load_cuda_runtime

log = logging.getLogger(__name__)

# Mooncake reads its transfer timeout from MC_TRANSFER_TIMEOUT (whole seconds) when the engine is built, and
# raises anything under 5 s to 5 s. Its synchronous batch call gives up after timeout + 1 ns per byte of the
# batch, and returns while other tasks of the batch may still run: the bound below is what we assume of them.
MOONCAKE_MIN_TIMEOUT_S = 5
# TCP writes were reported complete before the peer had them until 0.3.12.post1 (Mooncake #2850): below it a
# "success" is no proof that the bytes are there.
MOONCAKE_MIN_VERSION = (0, 3, 12, 1)
# the most bytes one batch call may cover (--max-write-bytes): 32 MiB add 34 ms to the landing bound and move in
# ~30 ms on loopback, so a call costs little more than one of a whole prompt's pages would
DEFAULT_MAX_WRITE_BYTES = 32 << 20


# Mooncake opens two listening ports, both drawn at random from [MC_MIN_RPC_PORT, MC_MAX_RPC_PORT] (default
# 15000-17000): the P2P handshake's RPC port (TransferEngineImpl::init, the session's port) and the tcp
# transport's data port (TcpTransport::install), both via findAvailableTcpPort. A range of exactly two ports
# therefore fixes both, in either order. Mooncake reads the range once, when its module is imported, and
# silently falls back to its default for a range that touches 32768-60999 (ValidatePortRange in config.cpp).
MOONCAKE_EPHEMERAL = range(32768, 61000)


def transfer_ports(port: int) -> tuple[int, int]:
    """The two ports Mooncake listens on for --transfer-port PORT; raises ValueError for one it would ignore."""
    pair = (port, port + 1)
    if port < 1024 or port + 1 > 65535 or any(p in MOONCAKE_EPHEMERAL for p in pair):
        raise ValueError(f"--transfer-port {port}: Mooncake needs {port} and {port + 1} in 1024-65535 outside "
                         f"{MOONCAKE_EPHEMERAL.start}-{MOONCAKE_EPHEMERAL.stop - 1} (it would silently pick "
                         "random ports instead)")
    return pair


def _pin_ports(port: int) -> tuple[int, int]:
    pair = transfer_ports(port)
    want = {"MC_MIN_RPC_PORT": str(pair[0]), "MC_MAX_RPC_PORT": str(pair[1])}
    if "mooncake.engine" in sys.modules and any(os.environ.get(k) != v for k, v in want.items()):
        raise RuntimeError(f"--transfer-port {port}: Mooncake was imported before its port range was set "
                           f"(MC_MIN_RPC_PORT={os.environ.get('MC_MIN_RPC_PORT')}, "
                           f"MC_MAX_RPC_PORT={os.environ.get('MC_MAX_RPC_PORT')})")
    os.environ.update(want)
    return pair


def timeout_error(timeout_s: float) -> str | None:
    """Why Mooncake cannot run with this transfer timeout, or None."""
    if int(timeout_s) != timeout_s or timeout_s < MOONCAKE_MIN_TIMEOUT_S:
        return (f"Mooncake transfer timeout {timeout_s}s: must be whole seconds >= {MOONCAKE_MIN_TIMEOUT_S} "
                f"(Mooncake raises anything lower to {MOONCAKE_MIN_TIMEOUT_S})")
    return None


def landing_bound_s(timeout_s: float, nbytes: int, slack_s: float) -> float:
    """L: the longest from a batch call's post to its last byte landing, for calls of at most nbytes. A call
    starts its timer before it posts anything (a retry inside the call keeps the first timer) and gives up
    timeout_s + 1 ns per byte of its batch after that start; a task still in flight when it returns lands within
    slack_s. So every byte lands within L of the post of its own call; a write of many calls takes longer, but
    each call is posted only after its own liveness check (prefill/worker.py), and prefill/writelease.py says why
    L <= lock_delay then suffices."""
    return timeout_s + nbytes * 1e-9 + slack_s


def check_mooncake_version() -> str:
    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        parts = [int(x) for x in version.replace(".post", ".").split(".")[:4] if x.isdigit()]
        if tuple(parts + [0] * (4 - len(parts))) < MOONCAKE_MIN_VERSION:
            raise RuntimeError(f"{dist} {version} reports TCP writes complete before the peer has them (#2850); "
                               "pdserve needs 0.3.12.post1 or later")
        return version
    raise RuntimeError("no Mooncake transfer engine package is installed: pip install 'pdserve[cpu]' (its non-CUDA "
                       "build) or 'pdserve[cuda]' on a CUDA host; in a checkout, `make setup`")


class TransferError(Exception):
    """posted: whether any byte may have been handed to the transport (then it may still land later)."""

    def __init__(self, stage: str, message: str, posted: bool = True):
        super().__init__(message)
        self.stage = stage
        self.posted = posted


@dataclass(slots=True, frozen=True)
class Run:
    src: int
    dst: int
    nbytes: int


def coalesce(src_pages: list[int], dst_pages: list[int], src_base: int, dst_base: int,
             stride: int) -> list[Run]:
    """One Run per maximal stretch where both source and destination pages are consecutive."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    runs: list[Run] = []
    i = 0
    while i < len(src_pages):
        j = i + 1
        while j < len(src_pages) and src_pages[j] == src_pages[j - 1] + 1 and dst_pages[j] == dst_pages[j - 1] + 1:
            j += 1
        runs.append(Run(src_base + src_pages[i] * stride, dst_base + dst_pages[i] * stride, (j - i) * stride))
        i = j
    return runs


def split_calls(runs: list[Run], max_bytes: int, stride: int) -> list[list[Run]]:
    """The runs, in order, as batch calls of at most max_bytes each; a run that does not fit in what is left of a
    call is cut at a multiple of stride (a page, a tag), so no page is split across calls. Raises ValueError when
    one stride exceeds max_bytes."""
    if stride > max_bytes:
        raise ValueError(f"one page of {stride} bytes does not fit in a write unit of {max_bytes} bytes")
    calls: list[list[Run]] = []
    batch: list[Run] = []
    room = max_bytes
    for run in runs:
        done = 0
        while done < run.nbytes:
            if room < stride:
                calls.append(batch)
                batch, room = [], max_bytes
            take = min(run.nbytes - done, room // stride * stride)
            batch.append(Run(run.src + done, run.dst + done, take))
            done += take
            room -= take
    if batch:
        calls.append(batch)
    return calls


def mooncake_import_hint(e: ImportError) -> str:
    """What to do about a Mooncake that does not load: the NVIDIA driver's library is missing on a host without
    one (Mooncake's CUDA build, the cuda extra, links it), anything else is a Debian library."""
    if "libcuda.so" in str(e):
        return (f"Mooncake transfer engine unavailable ({e}): this is Mooncake's CUDA build (the cuda extra, the CUDA "
                "image), which needs the NVIDIA driver's libcuda.so.1: run it on a GPU node (with the NVIDIA "
                "container runtime in a container), or install the cpu extra on a host without a GPU")
    return (f"Mooncake transfer engine unavailable ({e}): on Debian or Ubuntu it needs libibverbs1 librdmacm1 "
            "libnuma1 libcurl4 (`deploy/install.sh apt runtime`; in a checkout, `make setup`)")


class TransferEngine:
    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 timeout_s: int = MOONCAKE_MIN_TIMEOUT_S, port: int = 0,
                 max_write_bytes: int = DEFAULT_MAX_WRITE_BYTES):
        """port: 0 lets Mooncake pick its ports; else it listens on port and port + 1 (transfer_ports).
        max_write_bytes: the most one write() may cover, the unit the landing bound is computed from."""
        if (err := timeout_error(timeout_s)) is not None:
            raise ValueError(err)
        if max_write_bytes < 1:
            raise ValueError(f"write unit of {max_write_bytes} bytes: must be >= 1")
        self.max_write_bytes = max_write_bytes
        self.version = check_mooncake_version()
        pair = _pin_ports(port) if port else None
        load_cuda_runtime()  # the CUDA build's libcudart.so.12, from its wheel (builds.py)
        try:
            from mooncake.engine import TransferEngine as _MooncakeEngine
        except ImportError as e:  # engine.so needs Debian's libraries (deploy/install.sh apt runtime) even for tcp
            raise RuntimeError(mooncake_import_hint(e)) from e
        # set explicitly, never inherited: every timing bound of the lease protocol is derived from it
        os.environ["MC_TRANSFER_TIMEOUT"] = str(int(timeout_s))
        self.timeout_s = int(timeout_s)
        self._engine = _MooncakeEngine()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise RuntimeError(f"Mooncake initialize({hostname!r}, P2PHANDSHAKE, {protocol!r}) returned {rc}")
        self._inflight = Inflight(self._engine.transfer_check_status)
        self.hostname = hostname
        self.protocol = protocol
        rpc_port = self._engine.get_rpc_port()
        if pair and rpc_port not in pair:
            raise RuntimeError(f"--transfer-port {port}: Mooncake's handshake port is {rpc_port}, not one of {pair}")
        self.session = f"{hostname}:{rpc_port}"
        if pair:
            log.info("Mooncake listens on %d (handshake, session %s) and %d (%s data)", rpc_port, self.session,
                     pair[1] if rpc_port == pair[0] else pair[0], protocol)

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self._engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory({ptr:#x}, {nbytes}) returned {rc}")

    def unregister(self, ptr: int) -> None:
        self._engine.unregister_memory(ptr)

    def write(self, session: str, runs: list[Run], stage: str, owner: bytes = b"") -> int:
        """Writes every run to `session` as one call and waits for it asleep; returns bytes moved. Raises
        TransferError at the first failed task or once the call's deadline has passed (other tasks of the call
        may still be in flight then and land later: the landing bound covers them), or ValueError before posting
        anything when the runs exceed the write unit (the declared landing bound would not cover them). A write
        that must land after this one is posted only once this has returned: calls are not ordered on the wire.
        owner: the request whose KV it is, named only in a fault point's record."""
        nbytes = sum(r.nbytes for r in runs)
        if nbytes > self.max_write_bytes:
            raise ValueError(f"a batch call of {len(runs)} runs ({nbytes} bytes) exceeds the write unit of "
                             f"{self.max_write_bytes} bytes that the landing bound is computed from")
        if not runs:
            return 0
        if stage == "data" and (arg := FAULTS.fire("transfer.fail_then_land", owner)) is not None:
            # as Mooncake does: the call reports failure while a task of its batch still runs and lands later,
            # reading the source pages as they are then
            delay_s = int(arg or 200) / 1000
            timer = threading.Timer(delay_s, self._post_unwatched, (session, runs, stage))
            timer.daemon = True
            timer.start()
            raise TransferError(stage, f"fault transfer.fail_then_land: {len(runs)} runs to {session} reported "
                                       f"failed; they land in {delay_s:.3f}s")
        # the call's clock starts before its first task is posted, as Mooncake's synchronous call's does: the
        # landing bound (landing_bound_s) counts from here
        deadline = time.monotonic() + self.timeout_s + nbytes * 1e-9
        ids: list[int] = []
        try:
            for r in runs:
                # one task per Mooncake batch: transfer_check_status, the one status call of Mooncake's Python
                # binding that does not wait, reads only a batch's first task
                bid = self._engine.transfer_submit_write(session, r.src, r.dst, r.nbytes)
                if not bid:
                    raise TransferError(stage, f"Mooncake refused to post run {len(ids) + 1} of {len(runs)} "
                                               f"({r.nbytes} bytes) of a write of {nbytes} bytes to {session}")
                ids.append(bid)
            what = f"Mooncake write of {len(runs)} runs ({nbytes} bytes) to {session}"
            ids = _wait(self._engine.transfer_check_status, ids, deadline, stage, what)
        finally:
            self._inflight.adopt(ids)  # whatever still runs once the call is answered (none when it completed)
        return nbytes

    def _post_unwatched(self, session: str, runs: list[Run], stage: str) -> None:
        self._inflight.adopt([bid for r in runs if (bid := self._engine.transfer_submit_write(
            session, r.src, r.dst, r.nbytes))])


# A waiting writer sleeps between looks at its tasks: briefly after its post (a page of a small model lands in tens
# of microseconds), a quarter longer after each look that found one still running, so a wait ends at most about a
# quarter of its length after its last task completed, and never sleeps past POLL_MAX_S.
POLL_FIRST_S = 20e-6
POLL_GROWTH = 1.25
POLL_MAX_S = 1e-3


def _wait(check, ids: list[int], deadline: float, stage: str, what: str) -> list[int]:
    """Sleeps until every task has ended; returns [] once all completed. Raises TransferError at the first failed
    task, or at the deadline with tasks still running; ids is emptied of the tasks that ended as it goes, so what
    it holds then is what still runs."""
    sleep_s = POLL_FIRST_S
    _fine_timer_slack()
    while True:
        failed, running = None, []
        for i, bid in enumerate(ids):
            try:
                rc = check(bid)  # 1 completed (its batch freed), -1 failed (freed), -2 timed out (kept), 0 running
            except Exception as e:
                # that task is let go (a second look could be at a freed batch); the rest are kept
                ids[:] = running + ids[i + 1:]
                raise TransferError(stage, f"{what}: a task's status could not be read ({e}); {len(ids)} of its "
                                           "tasks still running may land later") from e
            if rc == 0:
                running.append(bid)
            elif rc != 1 and failed is None:
                failed = rc
        ids[:] = running  # one pass: a call of many runs no longer pays a list.remove per ended task
        if failed is not None:
            raise TransferError(stage, f"{what} failed (task status {failed}); {len(ids)} of its tasks still "
                                       "running may land later")
        if not ids:
            return ids
        if (now := time.monotonic()) > deadline:
            raise TransferError(stage, f"{what}: {len(ids)} tasks still running past its deadline "
                                       f"({now - deadline:.3f}s over); they may land later")
        time.sleep(min(sleep_s, max(0.0, deadline - now)))
        sleep_s = min(POLL_MAX_S, sleep_s * POLL_GROWTH)


_slack_set = threading.local()


def _fine_timer_slack() -> None:
    """Linux wakes a sleeping thread up to its timer slack late, 50 us by default: as long as a small write takes.
    A waiting writer's sleeps are what it is timed by, so its thread asks for 1 us (once per thread)."""
    if getattr(_slack_set, "done", False) or sys.platform != "linux":
        return
    _slack_set.done = True
    import ctypes
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0) != 0:  # PR_SET_TIMERSLACK, in nanoseconds
            log.info("prctl(PR_SET_TIMERSLACK) failed (errno %d): a writer's sleeps may run 50 us long",
                     ctypes.get_errno())
    except (OSError, AttributeError) as e:
        log.info("no prctl (%s): a writer's sleeps may run 50 us long", e)


# nobody waits for an adopted task: a look every 10 ms frees its batch soon enough
KEEP_POLL_S = 0.01
# an idle keeper's thread exits after this long (the next adoption starts it again): an engine nobody uses holds none
KEEP_LINGER_S = 2.0


class Inflight:
    """Keeps the tasks of answered calls that were still running (a failed sibling, the deadline, a fault's late
    post) until Mooncake says they ended: each is polled until then, so Mooncake frees its batch (it refuses to free
    one whose tasks run) and nothing polls a freed batch. The transport's outcome no longer matters to anyone: the
    call was answered as failed, and the landing bound, not this, protects the pages the task may still touch."""

    def __init__(self, check_status):
        self._check = check_status
        self._lock = threading.Condition()
        self._ids: list[int] = []
        self._thread: threading.Thread | None = None

    def adopt(self, ids: list[int]) -> None:
        if not ids:
            return
        with self._lock:
            self._ids.extend(ids)
            self._lock.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mooncake-inflight", daemon=True)
                self._thread.start()

    def __len__(self) -> int:
        """Tasks adopted and not yet ended."""
        with self._lock:
            return len(self._ids)

    def _ended(self, bid: int) -> bool:
        try:
            return self._check(bid) != 0
        except Exception as e:  # noqa: BLE001  (the keeper must go on looking after the others)
            log.warning("Mooncake batch %d: its status could not be read (%s); it is no longer looked at", bid, e)
            return True

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._ids:
                    self._lock.wait(KEEP_LINGER_S)
                    if not self._ids:
                        self._thread = None
                        return
                ids = list(self._ids)
            # -2 (Mooncake's transport timed it out, its batch kept): Mooncake will not say more; let it go
            ended = {bid for bid in ids if self._ended(bid)}
            with self._lock:
                self._ids = [bid for bid in self._ids if bid not in ended]
            time.sleep(KEEP_POLL_S)
