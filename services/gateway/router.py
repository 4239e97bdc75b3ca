"""Routing over prefill and decode instances by their load, and by where a prompt's prefix most likely is.

Each backend's load comes from its GetInfo, polled every --load-interval (backends.py): free pages and queue
depth. Between two polls the gateway adds what it sent there itself and the poll cannot have seen yet (a
ticket is seen by the first poll sent after the backend took the call), so a burst does not all land on the
backend that looked idlest half a second ago.

Decode: a backend with room for the request's pages first, then the lowest queue depth, then the most free
pages; prefill: the lowest queue depth. Ties go round-robin. Draining, refused, unreachable and removed
backends get no new work while any routable one is left (an unreachable one is tried only when no backend
of the role answered its last poll: the call itself then gives the clear error).

Prefix affinity (affinity.py; a request with a prefix scope): the ready, not excluded backend last sent the
longest prefix of the prompt is picked instead, unless it lacks the free pages the load choice has, or its queue
is more than max_load_gap deeper: a cached prefix saves its forward pass and transfer, not a wait behind a queue.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import grpc

from ..common.errors import PdError
from ..common.metrics import PREFIX_ROUTE_ENTRIES, PREFIX_ROUTES
from .affinity import PrefixMap

# backend states (the gateway's pdserve_gateway_backends{role,state} gauge counts them)
PENDING, READY, DRAINING, UNREACHABLE, REFUSED, RETIRING = (
    "pending", "ready", "draining", "unreachable", "refused", "retiring")
STATES = (PENDING, READY, DRAINING, UNREACHABLE, REFUSED, RETIRING)


@dataclass(eq=False)
class Ticket:
    """One request's share of a backend, counted until a poll has seen it."""
    pages: int
    settled_at: float | None = None  # when the backend took the call; None while the call is on its way


@dataclass(eq=False)
class Backend:
    target: str
    stub: object
    info: object = None
    in_flight: int = 0
    state: str = READY
    channel: object = None
    polled_at: float = 0.0  # monotonic time the last successful poll was sent
    tickets: set = field(default_factory=set)
    _order: int = 0

    def unseen(self) -> tuple[int, int]:
        """Requests and pages sent here that no poll has reported yet."""
        return len(self.tickets), sum(t.pages for t in self.tickets)

    def free_pages(self) -> int:
        return (self.info.free_pages if self.info is not None else 0) - self.unseen()[1]

    def queue_depth(self) -> int:
        return (self.info.queue_depth if self.info is not None else 0) + self.unseen()[0]

    def absorb(self, sent_at: float) -> None:
        """A poll sent at sent_at reports every ticket the backend had taken before it."""
        self.polled_at = sent_at
        self.tickets = {t for t in self.tickets if t.settled_at is None or t.settled_at >= sent_at}

    def take(self, pages: int = 0) -> Ticket:
        t = Ticket(pages)
        self.tickets.add(t)
        self.in_flight += 1
        return t

    @staticmethod
    def settle(ticket: Ticket) -> None:
        if ticket.settled_at is None:
            ticket.settled_at = time.monotonic()

    def done(self, ticket: Ticket) -> None:
        """The request left this backend; a ticket the backend never took is dropped (nothing to report)."""
        self.in_flight -= 1
        if ticket.settled_at is None:
            self.tickets.discard(ticket)


class Router:
    def __init__(self, role: str, backends: list[Backend] = (), prefixes: PrefixMap | None = None,
                 max_load_gap: int = 4):
        self.role = role
        self.all: list[Backend] = list(backends)
        self._tick = itertools.count()
        self.prefixes = PrefixMap() if prefixes is None else prefixes
        PREFIX_ROUTE_ENTRIES.labels(role).set_function(self.prefixes.__len__)
        self.max_load_gap = max_load_gap

    @property
    def backends(self) -> list[Backend]:
        """The backends that take new work now."""
        return [b for b in self.all if b.state == READY]

    def no_backend(self) -> PdError:
        """UNAVAILABLE NO_BACKEND, saying what the role's known backends are doing instead."""
        counts = {s: sum(b.state == s for b in self.all) for s in STATES}
        return PdError(grpc.StatusCode.UNAVAILABLE, "NO_BACKEND", f"no {self.role} instance takes work: "
                       f"{len(self.all)} known" + "".join(f", {n} {s}" for s, n in counts.items() if n))

    def pick(self, exclude: set[str] = frozenset(), pages: int = 0,
             prefix: list[tuple[int, bytes]] = ()) -> Backend:
        """prefix: the request's route keys (affinity.route_keys); empty: by load alone."""
        ready = self.backends
        pool = ready or [b for b in self.all if b.state == UNREACHABLE]
        if not pool:
            raise self.no_backend()
        candidates = [b for b in pool if b.target not in exclude] or pool
        if pages:
            best = min(candidates, key=lambda b: (b.free_pages() < pages, b.queue_depth(), -b.free_pages(), b._order))
        else:
            best = min(candidates, key=lambda b: (b.queue_depth(), b.in_flight, b._order))
        if prefix:
            best = self._affine(best, ready, exclude, pages, prefix)
        best._order = next(self._tick)
        return best

    def _affine(self, best: Backend, ready: list[Backend], exclude: set[str], pages: int,
                prefix: list[tuple[int, bytes]]) -> Backend:
        # only a backend that takes work and was not excluded by this request's retry: a failed or draining one
        # must not win back its traffic by holding a prefix
        eligible = {b.target: b for b in ready if b.target not in exclude}
        hit = self.prefixes.longest(prefix, eligible)
        chosen = best
        if hit is not None and self._near(eligible[hit[1]], best, pages):
            chosen = eligible[hit[1]]
        won = hit is not None and chosen is eligible[hit[1]]
        PREFIX_ROUTES.labels(self.role, "affinity" if won else "load").inc()
        self.prefixes.record(prefix, chosen.target)
        return chosen

    def _near(self, b: Backend, best: Backend, pages: int) -> bool:
        """b's load is within the bound of the load choice's."""
        if pages and b.free_pages() < pages <= best.free_pages():
            return False
        return b.queue_depth() - best.queue_depth() <= self.max_load_gap
