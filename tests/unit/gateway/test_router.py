"""The router's choice by load: free pages and queue depth from the last poll, minus what the gateway sent
since; draining and gone backends get nothing new."""
import time
from types import SimpleNamespace

import grpc
import pytest

from pdserve.common.errors import PdError
from pdserve.gateway.router import DRAINING, READY, REFUSED, RETIRING, UNREACHABLE, Backend, Router


def backend(name, free=100, depth=0, state=READY):
    return Backend(name, stub=None, info=SimpleNamespace(free_pages=free, queue_depth=depth), state=state)


def test_decode_goes_where_the_pages_fit_then_to_the_shortest_queue_then_the_most_free_pages():
    full = backend("full", free=3, depth=0)
    busy = backend("busy", free=90, depth=4)
    idle = backend("idle", free=50, depth=1)
    roomy = backend("roomy", free=80, depth=1)
    r = Router("decode", [full, busy, idle, roomy])
    assert r.pick(pages=4) is roomy  # full has the shortest queue but no room; roomy beats idle on free pages
    assert r.pick(pages=60) is roomy
    assert r.pick(pages=85) is busy  # only busy has room for 85 pages
    assert r.pick(pages=200) is full  # no room anywhere: the shortest queue, where it waits behind the fewest


def test_what_the_gateway_sent_counts_until_a_poll_sent_after_it_has_seen_it():
    a, b = backend("a", free=40), backend("b", free=40)
    r = Router("decode", [a, b])
    first = r.pick(pages=10)
    t1 = first.take(10)
    assert first.free_pages() == 30 and first.queue_depth() == 1
    other = r.pick(pages=10)
    assert other is not first  # the burst does not all land on the one that looked idlest
    t2 = other.take(10)
    first.absorb(time.monotonic())  # a poll sent before the backend took the call: it cannot have seen it
    assert first.free_pages() == 30
    Backend.settle(t1)
    first.info = SimpleNamespace(free_pages=30, queue_depth=1)
    first.absorb(time.monotonic())  # now it has
    assert first.free_pages() == 30 and first.queue_depth() == 1 and first.in_flight == 1
    other.done(t2)  # never reached the backend: nothing to wait for
    assert other.free_pages() == 40 and other.in_flight == 0
    first.done(t1)
    assert first.in_flight == 0


def test_a_burst_spreads_evenly_over_equal_backends():
    bs = [backend(f"d{i}", free=64) for i in range(3)]
    r = Router("decode", bs)
    for _ in range(9):
        r.pick(pages=4).take(4)
    assert [b.in_flight for b in bs] == [3, 3, 3]
    ps = [backend(f"p{i}") for i in range(2)]
    rp = Router("prefill", ps)
    ps[0].info.queue_depth = 3
    picks = [rp.pick() for _ in range(3)]
    for p in picks:
        p.take()
    assert [p.target for p in picks] == ["p1", "p1", "p1"]  # p1 catches up with p0's 3 first
    assert rp.pick() in ps


def test_draining_refused_and_retiring_backends_get_no_new_work():
    drain, refused, gone, ok = (backend("drain", free=1000, state=DRAINING), backend("ref", free=1000, state=REFUSED),
                                backend("gone", free=1000, state=RETIRING), backend("ok", free=1, depth=9))
    r = Router("decode", [drain, refused, gone, ok])
    assert all(r.pick(pages=1) is ok for _ in range(5))
    assert r.backends == [ok]


def test_a_retry_avoids_the_refusing_backend_unless_it_is_the_only_one():
    a, b = backend("a", depth=0), backend("b", depth=5)
    r = Router("prefill", [a, b])
    assert r.pick() is a
    assert r.pick(exclude={"a"}) is b
    assert Router("prefill", [a]).pick(exclude={"a"}) is a  # the retry then fails with the backend's own error


def test_unreachable_ones_only_when_none_answers_and_none_at_all_is_a_clear_unavailable():
    lost, ok = backend("lost", state=UNREACHABLE), backend("ok", depth=50)
    assert Router("decode", [lost, ok]).pick(pages=1) is ok
    assert Router("decode", [lost]).pick(pages=1) is lost
    with pytest.raises(PdError) as e:
        Router("decode", [backend("x", state=DRAINING), backend("y", state=REFUSED)]).pick()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.reason == "NO_BACKEND"
    assert "2 known" in e.value.message and "1 draining" in e.value.message and "1 refused" in e.value.message
