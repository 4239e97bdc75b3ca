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


# prefix affinity (issue 20)
from pdserve.common.metrics import PREFIX_ROUTES  # noqa: E402
from pdserve.gateway.affinity import PrefixMap, checkpoints, route_keys  # noqa: E402

SCOPE = b"s" * 16
BASE = list(range(100, 100 + 16 * 8 + 1))  # 8 full pages and a last token


def routes(role, result):
    return PREFIX_ROUTES.labels(role, result)._value.get()


def test_route_keys_name_the_scope_the_position_and_every_token_before():
    keys = route_keys(SCOPE, BASE, 16)
    assert [k for k, _ in keys] == list(range(1, 9))
    assert route_keys(b"t" * 16, BASE, 16)[0][1] != keys[0][1]  # another scope
    changed = BASE[:16 * 5] + [7] + BASE[16 * 5 + 1:]  # a token of page 6
    assert route_keys(SCOPE, changed, 16)[:5] == keys[:5]
    assert all(x != y for x, y in zip(route_keys(SCOPE, changed, 16)[5:], keys[5:]))  # page 6 and every one after
    assert all(x != y for x, y in zip(route_keys(SCOPE, [7] + BASE[1:], 16), keys))  # the first token: every page
    assert route_keys(SCOPE, BASE[:16], 16) == [] and route_keys(b"", BASE, 16) == []  # no full page; cache off
    assert route_keys(SCOPE, BASE[:16 * 3], 16) == keys[:2]  # the last token's page is not a full page
    assert checkpoints(40) == list(range(1, 17)) + [18, 20, 22, 24, 26, 28, 30, 32, 36, 40]
    assert len(checkpoints(1 << 16)) == 16 + 8 * 12 + 1 - 1  # 8 per doubling past 16, the last one included


def test_the_backend_last_sent_the_longest_prefix_is_picked_over_a_slightly_less_loaded_one():
    a, b = backend("a", free=100, depth=0), backend("b", free=100, depth=0)
    r = Router("decode", [a, b])
    short = route_keys(SCOPE, BASE[:16 * 4 + 1], 16)
    assert r.pick(pages=1, prefix=short) is a  # nothing known: by load
    long = route_keys(SCOPE, BASE, 16)
    before = routes("decode", "affinity")
    a.info.queue_depth = 1
    assert r.pick(pages=1, prefix=long) is a  # its first 4 pages went to a; a is busier, within the gap
    a.info.queue_depth = 10
    assert r.pick(pages=1, prefix=long) is b  # past the gap: by load, and b is the one last sent all 8 pages
    a.info.queue_depth, b.info.queue_depth = 0, 2  # b is busier now, within the gap
    assert r.pick(pages=1, prefix=long) is b
    assert r.pick(pages=1, prefix=short) is b  # the 4-page prefix went with the 8 pages
    other = route_keys(SCOPE, BASE[:16 * 2] + [1] * (16 * 6 + 1), 16)  # shares 2 pages only
    assert r.pick(pages=1, prefix=other) is b
    assert r.pick(pages=1, prefix=route_keys(b"t" * 16, BASE, 16)) is a  # another scope: by load
    assert routes("decode", "affinity") == before + 4


def test_past_the_load_gap_or_without_room_the_least_loaded_wins():
    a, b = backend("a", free=100, depth=0), backend("b", free=100, depth=0)
    r = Router("prefill", [a, b], max_load_gap=3)
    keys = route_keys(SCOPE, BASE, 16)
    r.prefixes.record(keys, "a")
    a.info.queue_depth = 3
    assert r.pick(prefix=keys) is a  # 3 deeper: within the gap
    a.info.queue_depth = 4
    before = routes("prefill", "load")
    assert r.pick(prefix=keys) is b  # 4 deeper: past it
    assert routes("prefill", "load") == before + 1
    assert r.prefixes.longest(keys, {"a", "b"}) == (8, "b")  # b was sent it last
    d, e = backend("d", free=5, depth=0), backend("e", free=50, depth=0)
    rd = Router("decode", [d, e])
    rd.prefixes.record(keys, "d")
    assert rd.pick(pages=10, prefix=keys) is e  # d holds the prefix but has no room for the request
    e.info.free_pages = 8
    assert rd.pick(pages=10, prefix=keys) is e  # no room anywhere: the load rule decides, as before


def test_an_excluded_or_draining_backend_is_never_picked_for_its_prefix():
    a, b = backend("a", free=100, depth=0), backend("b", free=100, depth=3)
    r = Router("decode", [a, b])
    keys = route_keys(SCOPE, BASE, 16)
    r.prefixes.record(keys[:4], "b")
    r.prefixes.record(keys, "a")
    assert r.pick(pages=1, prefix=keys, exclude={"a"}) is b  # a's longer prefix is excluded: b's shorter one
    r.prefixes.record(keys, "a")
    a.state = DRAINING
    assert r.pick(pages=1, prefix=keys) is b
    a.state, b.state = READY, UNREACHABLE
    r.prefixes.record(keys, "b")
    assert r.pick(pages=1, prefix=keys) is a  # b answers no poll: never for affinity
    a.state = DRAINING  # nothing takes work: the unreachable one is tried, but not for affinity
    before = routes("decode", "affinity")
    assert r.pick(pages=1, prefix=keys) is b and routes("decode", "affinity") == before


def test_the_prefix_map_is_bounded_and_forgets_the_least_recently_used():
    m = PrefixMap(max_entries=3)
    keys = route_keys(SCOPE, BASE, 16)
    m.record(keys[:2], "a")
    m.record(keys[2:4], "b")
    assert len(m) == 3 and m.longest(keys[:1], {"a", "b"}) is None  # keys[0] went first
    assert m.longest(keys[:2], {"a", "b"}) == (2, "a") and m.longest(keys, {"a", "b"}) == (4, "b")
    m.record(keys, "c")
    assert len(m) == 3 and m.longest(keys, {"a", "b", "c"}) == (8, "c") and m.longest(keys[:5], {"c"}) is None
    with pytest.raises(ValueError):
        PrefixMap(0)
