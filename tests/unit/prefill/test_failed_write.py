"""Prefill's servicer against a fake transport that does what Mooncake's batch call can do: report failure while
the write is still in flight, then land it 200 ms later, reading the source pages as they are at that moment.
The failed write is acknowledged as posted (the broker then holds the destination for lock_delay), and its
source pages stay out of reuse until the landing bound, so the next request's KV never rides the late write."""
import asyncio
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from pdserve.common.errors import PdError
from pdserve.common.proto import broker_pb2, common_pb2, prefill_pb2
from pdserve.kvtransfer.engine import TransferError
from pdserve.prefill.local_pages import LocalPages
from pdserve.prefill.servicer import PrefillServicer
from pdserve.prefill.worker import Forward

PAGE, LAND_S, BOUND_S = 4, 0.2, 1.5


class FakeWorker:
    """Source pages hold one marker each (the first prompt token); the destination pool is a dict."""

    def __init__(self):
        self.runner = SimpleNamespace(config=SimpleNamespace(vocab_size=100, eos_token_id=None))
        self.pool = SimpleNamespace(num_pages=8, page_size=PAGE, layout=SimpleNamespace(
            num_layers=1, num_kv_heads=1, head_dim=1, page_size=PAGE, dtype="float32", page_nbytes=16))
        self.local = LocalPages(8, lambda pages: [0] * len(pages), max_cached_pages=0)
        self.alloc = self.local.alloc
        self.source = [0] * 8
        self.dest: dict[int, int] = {}
        self.fail_next = False

    def forward(self, chunks) -> list[Forward]:
        for prompt, _, _ in chunks:
            for p in prompt.pages:
                self.source[p] = prompt.token_ids[0]
        return [Forward(7, None, []) for _ in chunks]

    def send(self, owner, prompt, target, check_alive, progress):
        local = prompt.pages
        check_alive("data")
        progress.posted = True
        pairs = [(src, dst) for src, (dst, _) in zip(local, target.leases)]

        def land():
            for src, dst in pairs:
                self.dest[dst] = self.source[src]  # what the source holds when the task runs
        if self.fail_next:
            self.fail_next = False
            threading.Timer(LAND_S, land).start()
            raise TransferError("data", "fake transport: batch reported failed, a task still runs")
        land()
        return SimpleNamespace(num_tokens=len(local) * PAGE, num_pages=len(local), checksums=[0] * len(local),
                               nbytes=16 * len(local), seconds=0.001, page_crcs={})


class FakeLeases:
    writer_prefix, max_landing_s, liveness_margin_s, rpc_timeout_s = "prefill/p0/1", BOUND_S, 0.1, 1.0

    def __init__(self):
        self.acks = []
        self.region = None

    async def begin(self, pool_id, owner, epoch, leases_pb, writer_id, deadline=None):
        return [time.monotonic() + 60], asyncio.create_task(asyncio.sleep(3600)), self.region

    async def end(self, pool_id, owner, epoch, leases_pb, writer_id, ok, nothing_posted, coverage=None, first_token=0,
                  prompt_digest=b""):
        self.acks.append((owner, ok, nothing_posted))
        # what the broker's write-done notice hands to decode: only a successful write carries it
        assert (coverage is not None) == ok and (coverage is None or coverage.num_tokens > 0)
        assert len(prompt_digest) == (16 if ok else 0)


def request(servicer, owner: bytes, marker: int, pages: list[int]) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request_id=owner, token_ids=[marker] * (PAGE * len(pages)),
        sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0, top_p=1.0),
        destination=common_pb2.Destination(
            pool_id="decode/d0/x", transfer_session="d:1", data_base=0x1000, tag_base=0x2000, epoch=1,
            leases=[common_pb2.PageLease(page=p, generation=1) for p in pages], layout=servicer.layout_pb))


def serving(registered_session: str = "d:1") -> tuple[FakeWorker, FakeLeases, PrefillServicer]:
    """A servicer whose broker hands out the pool registered at `registered_session` (requests name "d:1")."""
    worker, leases = FakeWorker(), FakeLeases()
    servicer = PrefillServicer(worker, leases, context_length=64, max_prompt=32, model_name="fake")
    leases.region = broker_pb2.PoolRegion(transfer_session=registered_session, data_base=0x1000, tag_base=0x2000,
                                          layout=servicer.layout_pb)
    return worker, leases, servicer


def test_a_failed_write_that_lands_late_carries_only_its_own_kv():
    async def main():
        worker, leases, servicer = serving()
        a, b = bytes([1]) * 16, bytes([2]) * 16
        worker.fail_next = True
        with pytest.raises(PdError) as info:
            await servicer.Prefill(request(servicer, a, 11, [0, 1]), None)
        failed = time.monotonic()
        assert (info.value.code, info.value.reason) == (grpc.StatusCode.UNAVAILABLE, "TRANSFER_FAILED")
        assert leases.acks == [(a, False, False)]  # posted: the broker must hold the destination
        free = worker.alloc.num_free  # read before the clock: pages back now were back before that reading
        assert free == 6 or time.monotonic() - failed >= BOUND_S  # A's two source pages are out of reuse
        # the next request runs at once, on other source pages, into other destination pages
        await servicer.Prefill(request(servicer, b, 22, [2, 3]), None)
        assert leases.acks[-1] == (b, True, False)
        await asyncio.sleep(LAND_S + 0.1)
        assert worker.dest == {0: 11, 1: 11, 2: 22, 3: 22}  # the late write carried A's KV, not B's
        free = worker.alloc.num_free
        assert free == 6 or time.monotonic() - failed >= BOUND_S  # a loaded machine may get here late
        while worker.alloc.num_free != 8:
            assert time.monotonic() - failed < BOUND_S + 1, "source pages never came back"
            await asyncio.sleep(0.02)
        assert time.monotonic() - failed >= BOUND_S - 0.05

    asyncio.run(main())


def test_a_write_refused_before_posting_frees_at_once_and_says_nothing_was_posted():
    async def main():
        worker, leases, servicer = serving(registered_session="elsewhere:9")
        with pytest.raises(PdError) as info:
            await servicer.Prefill(request(servicer, bytes([3]) * 16, 33, [0]), None)
        assert info.value.reason == "DESTINATION_MISMATCH"
        assert leases.acks == [(bytes([3]) * 16, False, True)] and worker.alloc.num_free == 8
        assert worker.dest == {}

    asyncio.run(main())
