"""Routing over prefill and decode instances: least in-flight first, ties broken round-robin."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class Backend:
    target: str
    stub: object
    info: object = None
    in_flight: int = 0
    _order: int = field(default=0)


class Router:
    def __init__(self, backends: list[Backend]):
        if not backends:
            raise ValueError("a router needs at least one backend")
        self.backends = backends
        self._tick = itertools.count()

    def pick(self, exclude: set[str] = frozenset()) -> Backend:
        candidates = [b for b in self.backends if b.target not in exclude] or self.backends
        best = min(candidates, key=lambda b: (b.in_flight, b._order))
        best._order = next(self._tick)
        return best
