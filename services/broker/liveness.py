"""Holders' liveness (docs/design.md §3, "Liveness"): holder id -> the monotonic time its record expires. A holder is
a writer renewing through KeepAlive, or one of the broker's own stand-ins for a write that may still land (a failed
write draining, a revoked owner's step, an unpublished page, an earlier epoch's writer). This object alone holds the
records.

A page a holder stands on (as its writer or pin) is released lock_delay after the holder's record expires, never
earlier; so a record only ever moves later while its holder may still be writing (`renew`, `start`), and moves
earlier only where the broker knows no write can begin any more (`end`)."""
from __future__ import annotations

from typing import Callable


class Liveness:
    def __init__(self, clock: Callable[[], float], default_ttl_s: float, lock_delay_s: float):
        self._clock = clock
        self._default_ttl_s = default_ttl_s
        self._lock_delay_s = lock_delay_s
        self._expiry: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._expiry)

    def renew(self, holder: str, until: float) -> None:
        """Live at least until `until`; never shortened, so a renewal with a small ttl cannot end a live writer's
        lease while it writes."""
        self._expiry[holder] = max(self._expiry.get(holder, until), until)

    def start(self, holder: str, now: float) -> None:
        """A record of one default ttl where none is live: an expired record counts as none, or the sweep could end
        a write that is only beginning."""
        if self._expiry.get(holder, now) <= now:
            self._expiry[holder] = now + self._default_ttl_s

    def end(self, holder: str, at: float | None = None) -> None:
        """The record expires at `at` (now when None), whatever it was."""
        self._expiry[holder] = self._clock() if at is None else at

    def hold(self, holder: str) -> None:
        """Live until `end`: a revoked owner's step may run until its reader acknowledges the revocation."""
        self._expiry[holder] = float("inf")

    def may_land(self, holder: str, now: float) -> bool:
        """Whether a write of holder's may still land: now < expiry + lock_delay. A holder without a record gets
        one default ttl from now (recorded), rather than being presumed dead at once."""
        return now < self._expiry.setdefault(holder, now + self._default_ttl_s) + self._lock_delay_s

    def prune(self, now: float) -> None:
        """Drops the records of holders past expiry + lock_delay: they block nothing any more."""
        self._expiry = {h: t for h, t in self._expiry.items() if now < t + self._lock_delay_s}
