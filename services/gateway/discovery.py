"""Where the gateway's backends are: static HOST:PORTs, a DNS name re-resolved, or a file re-read.

`dns:NAME:PORT` takes every A/AAAA record of NAME as one backend on PORT (a Kubernetes headless Service);
`file:PATH` takes one HOST:PORT per line (blank lines and `#` comments skipped), re-read when the file
changes. A source that fails to resolve or read keeps its last answer: a DNS hiccup must not pull every
backend out from under the traffic, while a record that is really gone disappears at the next good answer.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Awaitable, Callable

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]


def split_host_port(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {target!r}")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


async def resolve_dns(name: str, port: int) -> list[str]:
    """Every A/AAAA address of name, as HOST:PORT targets."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({join_host_port(info[4][0], port) for info in infos})


@dataclass(eq=False)
class Source:
    spec: str
    targets: set[str] = field(default_factory=set)

    async def refresh(self) -> set[str]:
        return self.targets


@dataclass(eq=False)
class StaticSource(Source):
    pass


@dataclass(eq=False)
class DnsSource(Source):
    name: str = ""
    port: int = 0
    resolver: Resolver = resolve_dns

    async def refresh(self) -> set[str]:
        try:
            self.targets = set(await self.resolver(self.name, self.port))
        except (OSError, socket.gaierror) as e:
            log.warning("discovery %s: cannot resolve %s (%s); keeping its %d known backends", self.spec,
                        self.name, e, len(self.targets))
        return self.targets


@dataclass(eq=False)
class FileSource(Source):
    path: str = ""
    _stamp: tuple | None = None

    async def refresh(self) -> set[str]:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == self._stamp:
                return self.targets
            with open(self.path) as f:
                lines = [ln.split("#", 1)[0].strip() for ln in f]
            targets = set()
            for ln in filter(None, lines):
                split_host_port(ln)  # a malformed line refuses the whole read: half a list is worse than the old one
                targets.add(ln)
        except (OSError, ValueError) as e:
            log.warning("discovery %s: cannot read it (%s); keeping its %d known backends", self.spec, e,
                        len(self.targets))
            return self.targets
        self._stamp, self.targets = stamp, targets
        return self.targets


def parse_spec(spec: str, resolver: Resolver = resolve_dns) -> Source:
    kind, sep, rest = spec.partition(":")
    if kind == "dns" and sep:
        name, port = split_host_port(rest)
        return DnsSource(spec, name=name, port=port, resolver=resolver)
    if kind == "file" and sep and rest:
        return FileSource(spec, path=rest)
    raise ValueError(f"discovery spec {spec!r}: expected dns:NAME:PORT or file:PATH")


class Discovery:
    """Follows every source of one role and reports the union whenever it changes, with the part of it that
    came from a name lookup or a file (dialled by address, so its certificate must name the role)."""

    def __init__(self, role: str, static: list[str], specs: list[str], on_change: Callable[[set[str], set[str]], None],
                 interval_s: float = 1.0, resolver: Resolver = resolve_dns):
        for t in static:
            split_host_port(t)
        self.role = role
        self.sources: list[Source] = [StaticSource(t, {t}) for t in static]
        self.sources += [parse_spec(s, resolver) for s in specs]
        self.on_change = on_change
        self.interval_s = interval_s
        self.current: set[str] | None = None

    async def refresh(self) -> set[str]:
        union: set[str] = set()
        discovered: set[str] = set()
        for src in self.sources:
            got = await src.refresh()
            union |= got
            if not isinstance(src, StaticSource):
                discovered |= got
        if union != self.current:
            if self.current is not None:
                log.info("discovery: %s backends now %s (added %s, removed %s)", self.role, sorted(union),
                         sorted(union - self.current), sorted(self.current - union))
            self.current = union
            self.on_change(set(union), discovered)
        return union

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval_s)
