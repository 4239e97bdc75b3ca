"""Fire-and-forget tasks that are not lost: asyncio keeps only weak references to tasks, so one nobody holds
can be garbage-collected before it runs to its end; the give-backs (Release, EndWrite) must not be."""
from __future__ import annotations

import asyncio
from typing import Coroutine

_RUNNING: set[asyncio.Task] = set()


def spawn(coro: Coroutine) -> asyncio.Task:
    """Schedules `coro` and keeps a reference to it until it is done. Only for work that ends by itself: a
    drain waits for every spawned task (drain.settle), so a loop spawned here would hold every exit up."""
    task = asyncio.ensure_future(coro)
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    return task
