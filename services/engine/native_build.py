"""Building the CPU kernels in csrc/ (no torch here: setup.py runs it in pip's build environment too)."""
from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = sorted(glob.glob(os.path.join(HERE, "csrc", "*.c")))
HEADERS = sorted(glob.glob(os.path.join(HERE, "csrc", "*.h")))  # included by the sources
# -ffast-math for the compile only: linked with it, gcc adds crtfastmath.o, which sets flush-to-zero for the whole
# process (torch included) when the library loads
COMPILE_FLAGS = ["-O3", "-ffast-math", "-fPIC", "-fno-semantic-interposition", "-Wno-psabi"]
LINK_FLAGS = ["-shared"]


def library_name(sources: list[str] = SOURCES) -> str:
    """Named after the sources and the flags: a stale build is never loaded."""
    h = hashlib.sha256(" ".join(COMPILE_FLAGS + LINK_FLAGS).encode())
    for src in [*sources, *(HEADERS if sources is SOURCES else ())]:
        with open(src, "rb") as f:
            h.update(os.path.basename(src).encode() + b"\0" + f.read())
    return f"pdserve-native-{h.hexdigest()[:16]}.so"


def search_dirs() -> list[str]:
    """Beside the package first (make setup, pip install, the images build there), then a per-user cache."""
    cache = os.environ.get("PDSERVE_NATIVE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pdserve",
                                                                  "native")
    return [os.path.join(HERE, "_native"), cache]


def build(out_dir: str | None = None, sources: list[str] = SOURCES) -> str:
    """Compiles the library into out_dir (the first of the search folders by default); returns its path.
    sources: other .c files than csrc's (e.g. an earlier revision's, to measure two builds side by side).
    Raises RuntimeError with the compiler's words when it cannot."""
    out_dir = out_dir or search_dirs()[0]
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, library_name(sources))
    for old in glob.glob(os.path.join(out_dir, ".build-*")):  # left by a build that was killed half-way
        with contextlib.suppress(OSError):
            if time.time() - os.path.getmtime(old) > 600:
                os.unlink(old)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out_dir)
    os.close(fd)
    objs = [f"{tmp[:-3]}-{i}.o" for i in range(len(sources))]
    try:
        cmds = [[cc, *COMPILE_FLAGS, "-c", "-o", obj, src] for obj, src in zip(objs, sources)]
        for cmd in [*cmds, [cc, *LINK_FLAGS, "-o", tmp, *objs, "-lm"]]:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, path)  # whole or absent: a concurrent loader never sees half a library
        for old in os.listdir(out_dir):  # builds of earlier sources (a process that mapped one keeps it)
            if old.startswith(("pdserve-native-", "paged_attention-")) and old.endswith(".so") \
                    and old != os.path.basename(path):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(out_dir, old))
    finally:
        for f in (tmp, *objs):
            if os.path.exists(f):
                os.unlink(f)
    return path
