"""Named fault points, inert unless the test-only switch PDSERVE_ENABLE_FAULTS=1 is on.

With the switch on they are armed by the environment (`PDSERVE_FAULTS="prefill.short_transfer:1,prefill.skip_page:1:2"`,
each `name[:count[:arg]]`, count 0 = every hit) or over the test-only `pdserve.v1.Faults` gRPC service, and the
service reports the unsafe mode `faults` (services/common/unsafe.py). With it off, PDSERVE_FAULTS is ignored
(logged at ERROR), nothing can be armed and no point fires: a stray variable in a production environment must
never corrupt a transfer. Each point reproduces one known failure.

With the switch on, the registry also keeps a record a chaos test reads back (Faults.TakeRecord) to tell a true
alarm from a false one: each point that fired, with the request (owner) it fired on, and each lease violation the
process counted, with the owner it was counted for. A DATA_LOSS or a violation with no fault of its own request
behind it is a false alarm. With the switch off nothing is recorded.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import NamedTuple

log = logging.getLogger(__name__)

KNOWN = {
    "prefill.short_transfer": "write only the first page (data and tag) and still report done (the incident)",
    "prefill.skip_page": "do not write page ARG (data and tag) and still report done",
    "prefill.bit_flip": "flip one byte of page ARG after its checksum was taken",
    "prefill.skip_tags": "write page data but lose every tag write",
    "prefill.delay_before_write": "sleep ARG ms after BeginWrite, before the writes",
    "prefill.lose_end_write": "never send EndWrite",
    "prefill.slow_transfer": "sleep ARG ms between the data writes and the tag writes (a stuck transfer)",
    "prefill.slow_forward": "sleep ARG ms (default 1000) at the start of the next prefill forward pass (work queues "
                            "behind it)",
    "prefill.crash_mid_transfer": "exit the process (as SIGKILL would) after the data writes, before the tags",
    "transfer.fail_then_land": "report the data write failed at once, then really post it ARG ms later (default "
                               "200), reading the source pages as they are then",
    "decode.corrupt_tag": "overwrite the tag of page ARG of the next request before its next step",
    "decode.rogue_data_write": "overwrite the data (not the tag) of prompt page ARG of the newest running request "
                               "before its first step (a late data-only write)",
    "decode.stall_step": "sleep ARG ms (default 1000) inside the next decode step's worker thread, before its forward "
                         "pass (a stalled step while the event loop keeps renewing)",
    "decode.corrupt_cached": "corrupt, in place, the first cached page the next Grant shares that no other request "
                             "reads, before decode checks it: "
                             "ARG bit_flip (one byte), foreign_tag (another request's tag and chain), "
                             "stale_generation (the tag one generation behind), late_write (another page's bytes "
                             "land on it, tag untouched)",
    "decode.fail_release": "drop the next Release to the broker as if the RPC failed (the pages leak until reconciled)",
    "broker.cut_watch": "end the next revocation stream to loop with UNAVAILABLE (a cut stream; decode resumes "
                        "from its cursor)",
    "broker.lose_grant_reply": "grant the pages, then fail the Grant RPC (the reply is lost)",
}


SWITCH = "PDSERVE_ENABLE_FAULTS"
# per kind of entry: a soak fires a point every 0.5-3 s; the oldest go first, and the reader is told how many
RECORD_LIMIT = 10_000


class Fired(NamedTuple):
    name: str
    owner: bytes  # b"": a point that acts on no one request (a stream, a step of a batch)
    arg: str


class Counted(NamedTuple):
    service: str
    reason: str
    owner: bytes


def faults_enabled() -> bool:
    return os.environ.get(SWITCH) == "1"


class FaultsDisabled(RuntimeError):
    pass


class FaultRegistry:
    def __init__(self, *, enabled: bool):
        self.enabled = enabled
        self._armed: dict[str, list] = {}
        self._lock = threading.Lock()
        self._fired: deque[Fired] = deque(maxlen=RECORD_LIMIT)
        self._counted: deque[Counted] = deque(maxlen=RECORD_LIMIT)
        self._dropped = 0

    def arm(self, name: str, count: int = 1, arg: str = "") -> None:
        if not self.enabled:
            raise FaultsDisabled(f"cannot arm fault point {name!r}: fault points are test-only and {SWITCH} is not 1")
        if name not in KNOWN:
            raise ValueError(f"unknown fault point {name!r}; known: {sorted(KNOWN)}")
        with self._lock:
            self._armed[name] = [count, arg]
        log.warning("fault point %s armed (count=%s arg=%r)", name, count, arg)

    def clear(self) -> None:
        with self._lock:
            self._armed.clear()

    def fire(self, name: str, owner: bytes = b"") -> str | None:
        """Returns the fault's argument ('' when none) if it fires on this hit, else None. owner: the request
        whose pages or write it acts on, recorded when it fires."""
        if not self.enabled:  # the hot path of every transfer: no lock when the switch is off
            return None
        with self._lock:
            entry = self._armed.get(name)
            if entry is None:
                return None
            count, arg = entry
            if count == 1:
                del self._armed[name]
            elif count > 1:
                entry[0] = count - 1
            self._append(self._fired, Fired(name, owner, arg))
        log.warning("fault point %s fired on %s (arg=%r)", name, owner.hex() or "no one request", arg)
        return arg

    def counted(self, service: str, reason: str, owner: bytes) -> None:
        """Records a lease violation this process counted, and for which request (nothing with the switch off)."""
        if not self.enabled:
            return
        with self._lock:
            self._append(self._counted, Counted(service, reason, owner))

    def take_record(self) -> tuple[list[Fired], list[Counted], int]:
        """What fired and what was counted since the last take, and how many entries the limit dropped."""
        with self._lock:
            out = list(self._fired), list(self._counted), self._dropped
            self._fired.clear()
            self._counted.clear()
            self._dropped = 0
        return out

    def _append(self, record: deque, entry) -> None:
        if len(record) == record.maxlen:
            self._dropped += 1
        record.append(entry)

    def load_env(self, value: str | None) -> None:
        if value and not self.enabled:
            log.error("PDSERVE_FAULTS=%r ignored: fault points are test-only and %s is not 1", value, SWITCH)
            return
        for item in filter(None, (value or "").split(",")):
            name, _, rest = item.partition(":")
            count, _, arg = rest.partition(":")
            self.arm(name.strip(), int(count or 1), arg)


FAULTS = FaultRegistry(enabled=faults_enabled())
FAULTS.load_env(os.environ.get("PDSERVE_FAULTS"))


def add_faults_service(server) -> None:
    """Serves pdserve.v1.Faults on `server` when PDSERVE_ENABLE_FAULTS=1; never otherwise."""
    if not FAULTS.enabled:
        return
    import grpc

    from .errors import PdError
    from .proto import faults_pb2, faults_pb2_grpc

    class FaultsServicer(faults_pb2_grpc.FaultsServicer):
        async def Arm(self, request, context):
            try:
                FAULTS.arm(request.name, request.count, request.arg)
            except ValueError as e:
                raise PdError(grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_FAULT", str(e)) from e
            return faults_pb2.ArmResponse()

        async def Clear(self, request, context):
            FAULTS.clear()
            return faults_pb2.ClearResponse()

        async def TakeRecord(self, request, context):
            fired, counted, dropped = FAULTS.take_record()
            return faults_pb2.FaultRecord(
                fired=[faults_pb2.FaultRecord.Fired(name=f.name, owner=f.owner, arg=f.arg) for f in fired],
                violations=[faults_pb2.FaultRecord.Violation(service=c.service, reason=c.reason, owner=c.owner)
                            for c in counted],
                dropped=dropped)

    faults_pb2_grpc.add_FaultsServicer_to_server(FaultsServicer(), server)
