"""A request's Publish that is still in flight when the request is released: the release waits for its answer,
so the pages it made cached are never canary-filled, and nothing of the owner stays behind (a Publish slower than
decode's RPC timeout once re-added the owner's read-only pages after its release)."""
import asyncio
import time

import torch

from pdserve.common.proto import broker_pb2
from pdserve.decode.allocations import Allocation
from pdserve.decode.reuse import PrefixPlan
from pdserve.decode.servicer import DecodeServicer
from pdserve.decode.verify import CANARY_BYTE
from pdserve.engine.runner import ModelRunner

from .test_servicer_killed import EPOCH, POOL, PS, Broker

RPC_TIMEOUT = 0.2


class SlowPublish(Broker):
    """Publish answers 2.5 x decode's RPC timeout late, caching the first page it names."""

    def Publish(self, req, timeout):
        self.calls.append(("Publish", req.owner))

        async def answer():
            await asyncio.sleep(2.5 * RPC_TIMEOUT)
            return broker_pb2.PublishResponse(published=[i == 0 for i in range(len(req.leases))])
        return answer()


def test_a_publish_answered_after_the_release_began_leaves_nothing_behind(model_dir):
    runner = ModelRunner(model_dir, num_pages=16, page_size=PS, device="cpu")

    async def main():
        broker = SlowPublish()
        servicer = DecodeServicer(runner, broker, POOL, "session", 4096, "tiny", max_blind_s=600.0, canary=True,
                                  rpc_timeout_s=RPC_TIMEOUT)
        servicer.link.epoch, servicer.link.heard_at = EPOCH, time.monotonic()
        owner, leases = b"o" * 16, [(2, 3), (3, 3), (4, 3)]
        plan = PrefixPlan(scope=b"s", tag=b"t" * 8, chains=[b"a" * 16, b"b" * 16], lookup=[b"a" * 16, b"b" * 16])
        alloc = Allocation(EPOCH, leases, 40, 8, time.monotonic() + 60, POOL, plan=plan)
        runner.pool.fill([2, 3, 4], 7)
        table = servicer.requests  # taken by Decode, its Publish started, then it ends and is released
        table.begin_grant(owner)
        table.take(owner, table.granted(owner, alloc))
        table.publish_started(owner, asyncio.ensure_future(servicer.grants.publish(owner, alloc, [11, 12, 13])))
        table.leave(owner)
        await asyncio.sleep(0)
        await servicer.release(owner, EPOCH, leases)
        await asyncio.sleep(3 * RPC_TIMEOUT)  # past any late answer
        assert owner not in servicer.readonly and owner not in servicer.publishing, servicer.readonly
        raw = [runner.pool.kv[p].view(torch.uint8) for p in range(5)]
        assert bool((raw[2] == 7).all()), "page 2 became cached: it must not be canary-filled"
        assert bool((raw[3] == CANARY_BYTE).all()) and bool((raw[4] == CANARY_BYTE).all())
        assert broker.named("Release") == [owner]
    asyncio.run(main())
