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

    def check(self, term: int, rpc: str) -> None:
        """Raises UNAVAILABLE OLD_TERM (counted) for an answer of a term older than the newest seen."""
        if term < self.newest:
            OLD_TERM_ANSWERS.labels(self.service, rpc).inc()
            raise PdError(grpc.StatusCode.UNAVAILABLE, "OLD_TERM",
                          f"broker {rpc} answered under term {term}, older than term {self.newest} this "
                          f"{self.service} has already seen: refused, nothing acted on (retryable)")
        self.newest = term

    def fresh(self, term: int, rpc: str) -> bool:
        """check() as a bool, for answers whose refusal is not an error of one request (a renewal, a stream)."""
        try:
            self.check(term, rpc)
            return True
        except PdError:
            return False
