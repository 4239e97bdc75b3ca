"""server.freeze_startup_objects: start-up's garbage is collected, what it keeps is frozen out of later full
collections (which would otherwise walk it every time)."""
import gc
import weakref

from pdserve.common.server import freeze_startup_objects


class _Node:
    pass


def test_garbage_is_collected_and_the_rest_frozen():
    gone, back = _Node(), _Node()
    gone.other, back.other = back, gone  # a cycle: only the collector frees it
    ref = weakref.ref(gone)
    del gone, back
    kept = _Node()
    kept.me = kept
    assert any(o is kept for o in gc.get_objects())
    try:
        n = freeze_startup_objects()
        assert ref() is None, "start-up garbage was frozen instead of freed"
        assert n == gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects()), "a kept object is still walked by full collections"
    finally:
        gc.unfreeze()
