"""Unsafe modes: switches that remove a guard of the guarantee (no response computed from another request's KV).

A service refuses to start when such a switch is on without the explicit opt-in `--allow-unsafe MODE` (repeat the
flag for several modes). Opted in, it logs every unsafe mode at ERROR at start-up and again every
`REMINDER_S` seconds (the log that is read at 3 a.m. is rarely the start-up one), and exports
`pdserve_unsafe_mode{service,mode}` = 1, which the alert PdserveUnsafeMode fires on; every known mode that is off
reads 0 from start-up. `faults` is the one mode whose switch (the test-only PDSERVE_ENABLE_FAULTS=1) is its own
opt-in: the tests that need it set it explicitly, and services/launcher.py never passes it on from a parent.

`--allow-pool-smaller-than-context` is deliberately not an unsafe mode: it removes no guard (admission is capped
at the pool, so every admitted request still fits its pages), its flag is already an explicit opt-in, and it has
its own shortfall metric and warning alert (services/common/capacity.py).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from typing import Iterable

from prometheus_client import Gauge

from .faults import FAULTS, SWITCH

log = logging.getLogger(__name__)

UNSAFE_MODE = Gauge("pdserve_unsafe_mode", "1 while this service runs with a guard switched off (--allow-unsafe)",
                    ["service", "mode"])
REMINDER_S = 600.0


@dataclass(frozen=True, slots=True)
class UnsafeMode:
    name: str
    switch: str  # what turns it on, as the operator typed it
    removes: str  # what the switch takes away, for the refusal and the log
    dest: str | None = None  # the argparse attribute of the switch; None: not a command-line flag
    own_opt_in: bool = False  # the switch is test-only and is itself the explicit opt-in


MODES = {m.name: m for m in (
    UnsafeMode("no-transfer-checksum", "--no-transfer-checksum",
               "removes the page checksum, the only check of the KV bytes themselves: a lost or late data write "
               "under intact tags is served (the formal model's mutant MUT_NO_CHECKSUM)", dest="no_transfer_checksum"),
    UnsafeMode("insecure", "--insecure",
               "removes mutual TLS and per-method authorisation between internal services: any pod can Grant, "
               "Release, Revoke, BeginWrite or KeepAlive any lease", dest="insecure"),
    UnsafeMode("faults", f"{SWITCH}=1",
               "arms test-only fault points that drop, corrupt or delay KV transfers on request", own_opt_in=True),
)}
OPT_IN_MODES = sorted(name for name, m in MODES.items() if not m.own_opt_in)


class UnsafeModeRefused(SystemExit):
    pass


def add_unsafe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-unsafe", action="append", default=[], choices=OPT_IN_MODES, metavar="MODE",
                   help=f"run with the unsafe switch of MODE on ({', '.join(OPT_IN_MODES)}); repeat the flag for "
                        "several. Logged at ERROR and exported as pdserve_unsafe_mode=1, which alerts")


def modes_in_use(args: argparse.Namespace) -> list[str]:
    """The unsafe modes whose switch is on in this process (a flag a service does not have counts as off)."""
    used = [m.name for m in MODES.values() if m.dest is not None and getattr(args, m.dest, False)]
    if FAULTS.enabled:
        used.append("faults")
    return used


def enable_unsafe(service: str, used: Iterable[str], allowed: Iterable[str]) -> list[str]:
    """Sets every known mode's gauge (0 or 1) and logs each mode in use at ERROR; raises UnsafeModeRefused,
    naming the switch, what it removes and the opt-in, when a mode in use was not opted into."""
    used, allowed = sorted(set(used)), set(allowed)
    for name in MODES:
        UNSAFE_MODE.labels(service, name).set(0)
    refused = [MODES[m] for m in used if not MODES[m].own_opt_in and m not in allowed]
    if refused:
        raise UnsafeModeRefused("\n".join(
            f"{service}: refusing to start: {m.switch} {m.removes}. Pass --allow-unsafe {m.name} to run without "
            f"that guard anyway (logged and exported as pdserve_unsafe_mode{{mode=\"{m.name}\"}} = 1)"
            for m in refused))
    for name in sorted(allowed - set(used)):
        log.warning("%s: --allow-unsafe %s given but %s is off: nothing to allow", service, name, MODES[name].switch)
    for name in used:
        UNSAFE_MODE.labels(service, name).set(1)
    log_unsafe(service, used)
    return used


def log_unsafe(service: str, used: Iterable[str]) -> None:
    for name in used:
        m = MODES[name]
        log.error("%s: UNSAFE MODE %s is on (%s): it %s", service, m.name, m.switch, m.removes)


_REMINDERS: list[asyncio.Task] = []


async def remind(service: str, used: list[str], every_s: float = REMINDER_S) -> None:
    while True:
        await asyncio.sleep(every_s)
        log_unsafe(service, used)


def check_unsafe(service: str, args: argparse.Namespace, every_s: float = REMINDER_S) -> list[str]:
    """Call first thing in a service's async serve(): refuses, or logs, exports and keeps reminding."""
    used = enable_unsafe(service, modes_in_use(args), getattr(args, "allow_unsafe", None) or [])
    if used:
        # held here, not spawned: spawned tasks are the give-backs a drain waits for (drain.settle), and this
        # one never ends
        _REMINDERS.append(asyncio.ensure_future(remind(service, used, every_s)))
    return used
