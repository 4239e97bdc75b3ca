"""The live backend set against fake stubs: a backend that disagrees on the model is refused loudly and
never routed to, load polls move backends between states, and a gone backend keeps its channel until its
requests have ended."""
import asyncio

from pdserve.common.proto import common_pb2
from pdserve.gateway import backends as backends_mod
from pdserve.gateway.backends import BACKENDS, Backends
from pdserve.gateway.router import DRAINING, PENDING, READY, REFUSED, RETIRING, Backend

LAYOUT = common_pb2.KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=16, dtype="float32")


class FakeStub:
    def __init__(self, **info):
        self.info = common_pb2.EngineInfo(model="tiny", vocab_size=512, page_size=16, layout=LAYOUT, pool_pages=64,
                                          context_length=4096, free_pages=64, **info)

    async def GetInfo(self, request, timeout=None):
        return self.info


class FakeChannel:
    closed = False

    async def close(self):
        self.closed = True


def gauge(role, state):
    return BACKENDS.labels(role, state)._value.get()


def add(bs: Backends, role: str, name: str, stub) -> Backend:
    b = Backend(name, stub, state=PENDING, channel=FakeChannel())
    bs.routers[role].all.append(b)
    bs._tasks[b] = asyncio.get_running_loop().create_task(bs._poll(role, b))
    return b


async def settle():
    await asyncio.sleep(0.05)


def test_disagreeing_backend_is_refused_and_states_follow_the_polls(monkeypatch, caplog):
    monkeypatch.setattr(backends_mod, "RELEASE_BOUND_S", 0.0)
    changes = []

    async def go():
        bs = Backends(None, load_interval_s=0.005, on_change=lambda: changes.append(1))
        assert all(gauge(r, s) == 0 for r in ("prefill", "decode") for s in (READY, REFUSED))
        d0 = add(bs, "decode", "d0", FakeStub())
        p0 = add(bs, "prefill", "p0", FakeStub())
        await settle()
        assert (d0.state, p0.state) == (READY, READY) and bs.is_usable()
        wrong = FakeStub()
        wrong.info.layout.page_size = 32
        d1 = add(bs, "decode", "d1", wrong)
        await settle()
        assert d1.state == REFUSED and bs.routers["decode"].backends == [d0]
        assert gauge("decode", REFUSED) == 1 and gauge("decode", READY) == 1
        d0.stub.info.draining = True
        await settle()
        assert d0.state == DRAINING and not bs.is_usable() and gauge("decode", DRAINING) == 1
        d0.stub.info.draining = False
        d0.stub.info.queue_depth = 7
        await settle()
        assert d0.state == READY and d0.queue_depth() == 7
        t = d0.take(4)
        bs.update("decode", {"d1"})  # d0 gone from discovery while a request runs on it
        assert d0.state == RETIRING and bs.routers["decode"].backends == [] and gauge("decode", RETIRING) == 1
        await settle()
        assert not d0.channel.closed  # its request still needs the pod that answered its Allocate
        d0.done(t)
        await asyncio.sleep(0.3)
        assert d0.channel.closed and d0 not in bs.routers["decode"].all and gauge("decode", RETIRING) == 0
        await bs.close()
    asyncio.run(go())
    assert changes
    refusals = [r for r in caplog.records if "REFUSED" in r.getMessage()]
    assert len(refusals) == 1 and "page_size: 32" in refusals[0].getMessage()
