"""Tells a true alarm from a false one in a chaos run. Every DATA_LOSS a client saw and every lease violation a
service counted (pdserve_lease_violations_total, decode's, prefill's and the broker's) is matched to a cause on
THAT request: a fault point that fired on its pages or its write and can make them wrong for their reader, a
pause or kill of the prefill that was writing it, a revocation the test made itself, or a hostile call's own
refused request. Whatever is left is unexplained (a false alarm, or an alarm whose cause nobody injected) and
fails the test.

The services' fault registries (services/common/faults.py, test-only) record each point that fired with the request
it fired on, and each violation they counted with the request it was counted for; Faults.TakeRecord reads and
forgets both. The gateway names a failed submission's request id, prefill and decode in the error's ErrorInfo
metadata; a stream's first message carries its request id."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.common.faults import KNOWN
from pdserve.common.proto import faults_pb2, faults_pb2_grpc

# what can make a page's content wrong for its reader: a corrupt or partial write, a write that lands late (after
# its writer was given up on), a page changed in place under its reader
CORRUPTING = frozenset({
    "prefill.short_transfer", "prefill.skip_page", "prefill.bit_flip", "prefill.skip_tags",
    "prefill.crash_mid_transfer", "prefill.delay_before_write", "prefill.slow_transfer", "transfer.fail_then_land",
    "decode.corrupt_tag", "decode.rogue_data_write", "decode.corrupt_cached",
})
# what cannot: a lost reply or acknowledgement, a cut stream, a slow pass or step, a failed Release. One of these
# on a request explains nothing about it
HARMLESS = frozenset({
    "broker.cut_watch", "broker.lose_grant_reply", "decode.fail_release", "prefill.lose_end_write",
    "decode.stall_step", "prefill.slow_forward",
})
assert CORRUPTING | HARMLESS == set(KNOWN) and not CORRUPTING & HARMLESS, \
    f"classify every fault point: {sorted(set(KNOWN) ^ (CORRUPTING | HARMLESS))}"
# a prefill's late write lands within its landing bound (chaos prefill: ~5.3 s) of the pause's end
LATE_WRITE_S = 6.0
SERVICES = ("prefill", "decode", "broker")


class Outcome(NamedTuple):
    """One client request: its tokens, its error (code, reason, message) if any, and the ids that name it."""
    kind: str
    prompt: list[int]
    tokens: list[int]
    err: tuple[str, str, str] | None
    request_id: bytes = b""  # the first message's, or the failed submission's (ErrorInfo metadata)
    prefill: str = ""  # the failed submission's prefill target (ErrorInfo metadata)
    start: float = 0.0  # time.monotonic() at the call and at its end
    end: float = 0.0


@dataclass
class Window:
    """A pause or kill of one process. Only a prefill's explains anything: a late write, for the requests whose
    failed submission that prefill served meanwhile (a paused or restarted decode or broker makes requests
    UNAVAILABLE, never DATA_LOSS)."""
    what: str
    target: str
    start: float
    end: float = float("inf")


@dataclass
class Record:
    """What every fault registry of a stack recorded over one test."""
    stack: object
    fired: dict[bytes, list[str]] = field(default_factory=dict)  # owner -> the points that fired on it
    violations: list[tuple[str, str, bytes, str]] = field(default_factory=list)  # (service, reason, owner, process)
    windows: list[Window] = field(default_factory=list)
    revoked: dict[bytes, str] = field(default_factory=dict)  # owner -> why the test revoked it
    hostile: set[bytes] = field(default_factory=set)  # owners of hostile calls' own requests
    _base: dict[tuple[str, int], float] = field(default_factory=dict)
    _counted_before_kill: list[str] = field(default_factory=list)
    _stubs: dict[str, object] = field(default_factory=dict)

    def start(self) -> "Record":
        """Forgets what came before (a previous test's faults) and notes each process's violation count."""
        for service, i in self._processes():
            self._take(service, i)
            self._base[service, i] = self._violations_metric(service, i)
        self.fired.clear()
        self.violations.clear()
        return self

    def before_kill(self, service: str, index: int) -> None:
        """Reads a process's record just before the test kills it (its registry dies with it)."""
        counted = self._violations_metric(service, index) - self._base[service, index]
        got = self._take(service, index)  # after the metric: what is counted meanwhile is in both or only here
        if got < counted:
            self._counted_before_kill.append(f"{service}[{index}]: {counted:.0f} counted, {got} recorded")
        self._base[service, index] = 0.0  # its successor counts from 0

    def finish(self) -> None:
        """Takes every record; each process must have recorded every violation it counted (no count without the
        request it was counted for)."""
        missing = list(self._counted_before_kill)
        for service, i in self._processes():
            got = self._take(service, i)
            counted = self._violations_metric(service, i) - self._base[service, i]
            if got != counted:
                missing.append(f"{service}[{i}]: {counted:.0f} counted, {got} recorded")
        assert not missing, f"violations counted without a record of their request: {missing}"

    def attribute(self, outcomes: list[Outcome], label: str) -> tuple[int, list[str]]:
        """Matches every client DATA_LOSS and every counted violation to a cause on its request; prints
        `attributed N / unexplained M` with each unexplained one, and returns (N, the unexplained)."""
        by_id = {o.request_id: o for o in outcomes if o.request_id}
        attributed: dict[str, int] = {}
        unexplained = []
        for o in outcomes:
            if o.err is None or o.err[0] != "DATA_LOSS":
                continue
            if (cause := self._cause(o.request_id, o)) is None:
                unexplained.append(f"request {o.request_id.hex() or '(no id)'}: {' '.join(o.err[:2])}: {o.err[2]} "
                                   f"[faults on it: {self.fired.get(o.request_id, [])}]")
            else:
                attributed[cause] = attributed.get(cause, 0) + 1
        for service, reason, owner, process in self.violations:
            o = by_id.get(owner)
            if (cause := self._cause(owner, o)) is None:
                seen = "no client saw it" if o is None else f"its client saw {o.err[:2] if o.err else 'success'}"
                unexplained.append(f"violation {service} {reason} for request {owner.hex()} (counted by {process}; "
                                   f"{seen}) [faults on it: {self.fired.get(owner, [])}]")
            else:
                attributed[cause] = attributed.get(cause, 0) + 1
        n = sum(attributed.values())
        losses = sum(o.err is not None and o.err[0] == "DATA_LOSS" for o in outcomes)
        print(f"  {label}: attributed {n} / unexplained {len(unexplained)} (of {losses} DATA_LOSS and "
              f"{len(self.violations)} violations; causes {dict(sorted(attributed.items()))})", flush=True)
        for line in unexplained:
            print(f"    UNEXPLAINED {line}", flush=True)
        return n, unexplained

    def _cause(self, owner: bytes, outcome: Outcome | None) -> str | None:
        if corrupting := [name for name in self.fired.get(owner, ()) if name in CORRUPTING]:
            return corrupting[0]
        if owner in self.revoked:
            return self.revoked[owner]
        if owner in self.hostile:
            return "hostile call"
        if outcome is not None and outcome.prefill:
            for w in self.windows:
                if w.target == outcome.prefill and outcome.start <= w.end + LATE_WRITE_S and outcome.end >= w.start:
                    return w.what
        return None

    def _processes(self):
        return [(s, i) for s in SERVICES for i in range(len(self.stack.procs[s]))]

    def _take(self, service: str, index: int) -> int:
        """Takes one process's record into this one; returns how many violations it held."""
        target = self.stack.procs[service][index].target
        if target not in self._stubs:
            self._stubs[target] = faults_pb2_grpc.FaultsStub(self.stack._ch(target))
        # wait_for_ready: a process just restarted may still be binding its port
        rec = self._stubs[target].TakeRecord(faults_pb2.TakeRecordRequest(), timeout=30, wait_for_ready=True)
        assert rec.dropped == 0, f"{service}[{index}] dropped {rec.dropped} record entries"
        for f in rec.fired:
            self.fired.setdefault(f.owner, []).append(f.name)
        process = f"{service}[{index}]"
        self.violations += [(v.service, v.reason, v.owner, process) for v in rec.violations]
        return len(rec.violations)

    def _violations_metric(self, service: str, index: int) -> float:
        return self.stack.metric(service, "pdserve_lease_violations_total", index=index)

