"""The newest broker election term this process has seen (docs/design.md §3, "Leader failover"): an answer given
under an older term came from a replica whose authority had ended, and nothing may act on it."""
from __future__ import annotations

import grpc

from .errors import PdError
from .metrics import OLD_TERM_ANSWERS


class Terms:
    def __init__(self, service: str) -> None:
        self.service = service
        self.newest = 0  # what every request that asks for an authorisation sends as term_seen
        self.floor = 0  # during a hand-over: the least term an answer may carry (newer than the one handed over)

    def check(self, term: int, rpc: str) -> None:
        """Raises UNAVAILABLE OLD_TERM (counted) for an answer of a term older than the newest seen (or, during a
        hand-over, not newer than the term handed over)."""
        if term < self.newest or term < self.floor:
            OLD_TERM_ANSWERS.labels(self.service, rpc).inc()
            least = max(self.newest, self.floor)
            raise PdError(grpc.StatusCode.UNAVAILABLE, "OLD_TERM",
                          f"broker {rpc} answered under term {term}; this {self.service} takes answers of term "
                          f"{least} or newer only: refused, nothing acted on (retryable)")
        self.newest = term

    def newer_only(self) -> int:
        """A hand-over to a new leader begins: from now on only a newer term's answers count (what decode hands
        over was decided now). Returns the term handed over."""
        self.floor = self.newest + 1
        return self.newest

    def any_term(self) -> None:
        """The hand-over was refused (decode registers anew instead): the floor goes."""
        self.floor = 0

    def fresh(self, term: int, rpc: str) -> bool:
        """check() as a bool, for answers whose refusal is not an error of one request (a renewal, a stream)."""
        try:
            self.check(term, rpc)
            return True
        except PdError:
            return False
