"""Ties a service to the process that started it: when the parent dies, even by SIGKILL, the service stops.

The launcher hands each child the read end of a pipe whose only write end stays in the launcher. The kernel
closes that write end when the launcher exits however it exits, so the child reads end-of-file: it then
SIGTERMs itself (the service's own graceful stop) and, should that stop hang, exits hard a few seconds later.
A pipe, not PR_SET_PDEATHSIG: that signal fires when the *thread* that forked the child exits, and the
launcher starts children from whichever thread calls it.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

ENV = "PDSERVE_LIFELINE_FD"
HARD_EXIT_S = 5.0  # the graceful stop's budget once the parent is gone; nobody is left to wait for a drain
HARD_EXIT_CODE = 70


def parent_end() -> tuple[int, int]:
    """(read end for the child, write end the parent keeps); neither is inherited by other children."""
    return os.pipe()


def watch_from_env(environ: dict | None = None) -> int | None:
    """In the child: watch the fd named by $PDSERVE_LIFELINE_FD, if any. Returns the fd watched."""
    environ = os.environ if environ is None else environ
    raw = environ.pop(ENV, None)  # a grandchild must not watch (or hold) our lifeline
    if raw is None:
        return None
    fd = int(raw)
    os.set_inheritable(fd, False)
    threading.Thread(target=_watch, args=(fd,), name="lifeline", daemon=True).start()
    return fd


def _watch(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 4096)
        except InterruptedError:
            continue
        except OSError as e:
            log.error("lifeline fd %d unreadable (%s): stopping as if the parent were gone", fd, e)
            break
        if not data:
            break
    log.warning("parent process gone (lifeline fd %d closed): stopping; hard exit in %.0f s", fd, HARD_EXIT_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(HARD_EXIT_S)
    log.error("still running %.0f s after the parent died: exiting hard", HARD_EXIT_S)
    os._exit(HARD_EXIT_CODE)
