"""The C heap of an engine process where it is glibc's (allocator.py runs engines under jemalloc where it is
installed): freed forward-pass buffers are kept for the next pass, not handed back.

A forward pass allocates and frees tensors of megabytes, op after op. glibc's defaults give such blocks back to the
kernel when they are freed (blocks above the mmap threshold are unmapped; a heap top above the trim threshold is
trimmed, and a worker thread's heap is trimmed eagerly), so the next pass takes them again as fresh zeroed pages,
one page fault each: 12,203 minor faults per 1,024-token prefill of the tiny model on a worker thread, and a pass
of 86 ms that took 72 ms once the blocks stayed (2 cores). Fixed thresholds keep them: blocks up to MMAP_THRESHOLD
come from the heap, and up to TRIM_THRESHOLD of free heap stays mapped. What a process keeps is bounded by its
largest pass's buffers (a request's size, never the pool's); the pool and the weights are allocated once.

An operator's own setting (GLIBC_TUNABLES, a MALLOC_* variable, an allocator in LD_PRELOAD) stands, and another C
library is left alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

from ..common.metrics import C_HEAP
from .allocator import chosen

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
MMAP_THRESHOLD = 32 << 20   # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit): bigger blocks are always mapped
TRIM_THRESHOLD = 256 << 20
_OWN_SETTINGS = ("GLIBC_TUNABLES", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
                 "MALLOC_ARENA_MAX", "LD_PRELOAD")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_bytes() -> tuple[int, int] | None:
    """(in use, free and kept) bytes of the C heap over every arena (glibc's mallinfo2), None where the C library
    has none. The free part is what the thresholds keep for the next pass: RSS swings by it, and it grows as the
    heap fragments under passes of every prompt length (allocator.py), with no live object behind the growth."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except AttributeError:
        return None
    fn.restype = _MallInfo2
    info = fn()
    return info.uordblks + info.hblkhd, info.fordblks


def keep_freed_memory() -> str:
    """Sets the thresholds (once per process is enough; again is harmless); returns what it did, for the log."""
    if "jemalloc" in os.environ.get("LD_PRELOAD", ""):
        return f"C heap: jemalloc (MALLOC_CONF={os.environ.get('MALLOC_CONF', '')}; services/engine/allocator.py)"
    if chosen() == "jemalloc" and not os.environ.get("LD_PRELOAD") and not ctypes.util.find_library("jemalloc"):
        log.warning("jemalloc is not installed (Debian's libjemalloc2; `make setup` installs it): the C heap is "
                    "glibc's, whose RSS swings by hundreds of MiB as its free heap fragments")
    if heap_bytes() is not None:
        for state, i in (("in_use", 0), ("free", 1)):
            C_HEAP.labels(state).set_function(lambda i=i: heap_bytes()[i])
    own = [k for k in _OWN_SETTINGS if os.environ.get(k)]
    if own:
        return f"C heap: the operator's settings stand ({', '.join(own)})"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        gnu = ctypes.CDLL(None).gnu_get_libc_version
    except (OSError, AttributeError):
        return "C heap: not glibc, its defaults stand"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        log.warning("mallopt refused the heap thresholds: freed forward-pass buffers go back to the kernel")
        return "C heap: glibc refused the thresholds, its defaults stand"
    gnu.restype = ctypes.c_char_p
    return (f"C heap: glibc {gnu().decode()} keeps freed blocks up to {MMAP_THRESHOLD >> 20} MiB and "
            f"{TRIM_THRESHOLD >> 20} MiB of free heap")
