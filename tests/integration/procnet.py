"""Who listens on which TCP port, read from /proc: tests check the real sockets, not what a service says."""
from __future__ import annotations

import os


def _listening_inodes() -> dict[str, int]:
    """socket inode ("socket:[N]") -> port, for every listening TCP socket (IPv4 and IPv6)."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] == "0A":
                    out[f"socket:[{cols[9]}]"] = int(cols[1].rsplit(":", 1)[1], 16)
    return out


def _socket_links(pid: int) -> set[str]:
    links = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return links


def listening_ports(pid: int) -> set[int]:
    """Every TCP port the process listens on."""
    inodes = _listening_inodes()
    return {inodes[link] for link in _socket_links(pid) if link in inodes}


def listeners(port: int) -> dict[int, str]:
    """pid -> command line of every process with a socket listening on port."""
    inodes = {inode for inode, p in _listening_inodes().items() if p == port}
    owners = {}
    for pid in filter(str.isdigit, os.listdir("/proc") if inodes else []):
        try:
            if _socket_links(int(pid)) & inodes:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    owners[int(pid)] = f.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
    return owners
