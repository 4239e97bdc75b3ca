"""Decode's servicer (grant, Run, _verify) over a real model and pool with a scripted broker: the guards a mutation
pass found no test failing without (issue 18, point 8). Decode refuses, before its first token, leases the broker
no longer vouches for; a Run reads on the write-done notice alone, and one whose allocation ended after its notice
came (the gateway's Release) sends nothing from the pages already given back; an abandoned Run or Allocate gives
its pages back; an allocation granted across a move to a new pool incarnation is never decoded; no Grant is sent
while decode is blind, and a moved broker's refusal is retryable."""
import asyncio
import random
import time
from types import SimpleNamespace

import grpc
import pytest

from pdserve.common.errors import PdError
from pdserve.common.proto import broker_pb2, common_pb2, decode_pb2
from pdserve.common.wire import prompt_digest
from pdserve.decode.servicer import DecodeServicer
from pdserve.engine.runner import ModelRunner
from pdserve.engine.tags import make_tags

PS, EPOCH, POOL = 16, 0x5EED, "decode/d0/p-00000000"


class Broker:
    """Grant hands out consecutive pages (waiting on `gate`, failing with `grant_error`); Validate answers
    `validate_error` or passes; every call is recorded."""

    def __init__(self):
        self.calls: list[tuple[str, bytes | str]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.grant_error = self.validate_error = None
        self.next_page, self.generation = 0, 3

    def Grant(self, req, timeout):
        self.calls.append(("Grant", req.owner))

        async def answer():
            await self.gate.wait()
            if self.grant_error is not None:
                raise self.grant_error
            pages = list(range(self.next_page, self.next_page + req.num_pages))
            self.next_page += req.num_pages
            return broker_pb2.GrantResponse(epoch=EPOCH, leases=[common_pb2.PageLease(page=p, generation=self.generation)
                                                                 for p in pages])
        return answer()

    def Validate(self, req, timeout):
        self.calls.append(("Validate", req.owner))

        async def answer():
            if self.validate_error is not None:
                raise self.validate_error
            return SimpleNamespace(term=0)
        return answer()

    def Release(self, req, timeout):
        self.calls.append(("Release", req.owner))

        async def answer():
            return SimpleNamespace(term=0)
        return answer()

    def RegisterPool(self, req, timeout):
        self.calls.append(("RegisterPool", req.pool_id))

        async def answer():
            return SimpleNamespace(epoch=EPOCH, lock_delay_ms=2_000_000, fence_ms=0, term=0)  # > 2 x max_blind
        return answer()

    def named(self, method: str) -> list:
        return [who for m, who in self.calls if m == method]


class Context:
    def time_remaining(self):
        return None


@pytest.fixture(scope="module")
def runner(model_dir):
    return ModelRunner(model_dir, num_pages=48, page_size=PS, device="cpu")


def _servicer(runner) -> tuple[DecodeServicer, Broker]:
    broker = Broker()
    servicer = DecodeServicer(runner, broker, POOL, "session", 4096, "tiny", max_blind_s=600.0)
    servicer.link.epoch, servicer.link.heard_at = EPOCH, time.monotonic()  # registered, the stream is up
    return servicer, broker


def _prompt(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(2, 512) for _ in range(n)]


def _prefill(runner, owner: bytes, leases, prompt: list[int]):
    """What prefill leaves in the destination: prompt KV (tail zeroed), then tags with checksums."""
    pool, n = runner.pool, -(-len(prompt) // PS)
    pages = [p for p, _ in leases[:n]]
    logits = runner.prefill(prompt, pages)
    pool.zero_tail(pages[-1], len(prompt) - (n - 1) * PS)
    checksums = pool.checksums(pages)
    pool.tags[pages] = make_tags(owner, EPOCH, [g for _, g in leases[:n]], len(prompt), PS, checksums)
    coverage = common_pb2.Coverage(num_tokens=len(prompt), num_pages=n, checksums=checksums)
    return int(logits[-1].argmax()), coverage


def _leases(destination) -> list[tuple[int, int]]:
    return [(x.page, x.generation) for x in destination.leases]


def _notice(owner, leases, prompt, first, coverage):
    n = -(-len(prompt) // PS)
    return broker_pb2.Revocation(owner=owner, epoch=EPOCH, write_done=True, first_token=first, coverage=coverage,
                                 prompt_digest=prompt_digest(prompt),
                                 leases=[common_pb2.PageLease(page=p, generation=g) for p, g in leases[:n]])


def _sampling(max_tokens: int):
    return common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)


async def _collect(stream) -> tuple[list, PdError | None]:
    got = []
    try:
        async for ev in stream:
            got.append(ev)
    except PdError as e:
        return got, e
    return got, None


@pytest.mark.parametrize("reason,want", [
    ("LEASE_NOT_CURRENT", (grpc.StatusCode.DATA_LOSS, "LEASE_NOT_CURRENT")),
    ("WRITER_ACTIVE", (grpc.StatusCode.DATA_LOSS, "WRITER_ACTIVE")),
    ("EPOCH_MISMATCH", (grpc.StatusCode.UNAVAILABLE, "EPOCH_MISMATCH")),
])
def test_decode_sends_no_token_from_leases_the_broker_refuses_to_validate(runner, reason, want):
    async def main():
        servicer, broker = _servicer(runner)
        loop = asyncio.create_task(servicer.scheduler.run())
        owner, prompt = b"v" * 16, _prompt(37, 1)
        dest = (await servicer.Allocate(decode_pb2.AllocateRequest(request_id=owner, num_prompt_tokens=37,
                                                                   max_tokens=6), Context())).destination
        first, coverage = _prefill(runner, owner, _leases(dest), prompt)  # tags and bytes all match the lease
        broker.validate_error = PdError(grpc.StatusCode.FAILED_PRECONDITION, reason, "page 0 generation 3: TEST")
        got, err = await _collect(servicer.Decode(decode_pb2.DecodeRequest(
            request_id=owner, num_prompt_tokens=37, first_token=first, sampling=_sampling(6), coverage=coverage),
            Context()))
        await asyncio.sleep(0.05)
        loop.cancel()
        return got, err, broker
    got, err, broker = asyncio.run(main())
    assert got == [] and err is not None and (err.code, err.reason) == want, err
    assert "TEST" in err.message
    assert broker.named("Validate") == [b"v" * 16] and broker.named("Release") == [b"v" * 16]


async def _run_until_destination(servicer, owner, prompt, max_tokens):
    stream = servicer.Run(decode_pb2.RunRequest(request_id=owner, num_prompt_tokens=len(prompt),
                                                sampling=_sampling(max_tokens), prompt_digest=prompt_digest(prompt)),
                          Context())
    first = await stream.__anext__()
    return stream, _leases(first.destination)


def test_a_run_reads_on_its_notice_alone_and_streams_tokens_of_its_own_kv(runner, oracle):
    async def main():
        servicer, broker = _servicer(runner)
        loop = asyncio.create_task(servicer.scheduler.run())
        owner, prompt = b"r" * 16, _prompt(41, 2)
        stream, leases = await _run_until_destination(servicer, owner, prompt, 6)
        first, coverage = _prefill(runner, owner, leases, prompt)
        servicer.notices.on_notice(_notice(owner, leases, prompt, first, coverage))
        got, err = await _collect(stream)
        await asyncio.sleep(0.05)
        loop.cancel()
        return prompt, got, err, broker
    prompt, got, err, broker = asyncio.run(main())
    assert err is None and len(got) == 6
    oracle.check(prompt, [ev.token.token_id for ev in got])
    # the notice stands for Validate: one Grant and the final Release are all the broker hears of it
    assert broker.calls == [("Grant", b"r" * 16), ("Release", b"r" * 16)]


def test_a_run_whose_allocation_is_released_right_after_its_notice_sends_nothing(runner):
    """The gateway's Release ends the allocation and gives the pages to the broker, which may grant them again at
    once; the notice already came. The Run must end with why its allocation ended, never decode those pages."""
    async def main():
        servicer, broker = _servicer(runner)
        loop = asyncio.create_task(servicer.scheduler.run())
        owner, prompt = b"x" * 16, _prompt(41, 3)
        stream, leases = await _run_until_destination(servicer, owner, prompt, 6)
        first, coverage = _prefill(runner, owner, leases, prompt)
        pending = asyncio.ensure_future(_collect(stream))
        await asyncio.sleep(0.05)  # the Run waits for its notice
        servicer.notices.on_notice(_notice(owner, leases, prompt, first, coverage))
        await servicer.Release(decode_pb2.DecodeReleaseRequest(request_id=owner), Context())  # no await before it ends
        got, err = await pending
        await asyncio.sleep(0.05)
        loop.cancel()
        return got, err, broker
    got, err, broker = asyncio.run(main())
    assert got == [] and err is not None and (err.code, err.reason) == (grpc.StatusCode.CANCELLED, "RELEASED"), err
    assert broker.named("Release") == [b"x" * 16]  # once, by the Release call


def test_a_run_abandoned_while_it_waits_for_its_notice_gives_its_pages_back(runner):
    async def main():
        servicer, broker = _servicer(runner)
        owner, prompt = b"a" * 16, _prompt(30, 4)
        stream, _ = await _run_until_destination(servicer, owner, prompt, 6)
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        task.cancel()  # the gateway went away
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        return servicer, broker
    servicer, broker = asyncio.run(main())
    assert broker.named("Release") == [b"a" * 16] and b"a" * 16 not in servicer.allocations
    assert servicer.held_owners() == set()


def test_a_run_with_a_malformed_prompt_digest_is_refused_before_any_grant(runner):
    async def main():
        servicer, broker = _servicer(runner)
        got, err = await _collect(servicer.Run(decode_pb2.RunRequest(
            request_id=b"d" * 16, num_prompt_tokens=30, sampling=_sampling(6), prompt_digest=b"abc"), Context()))
        return got, err, broker
    got, err, broker = asyncio.run(main())
    assert got == [] and (err.code, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "BAD_PROMPT_DIGEST"), err
    assert "got 3" in err.message and broker.calls == []


@pytest.mark.parametrize("state", ["blind", "fenced"])
def test_no_grant_is_sent_while_decode_is_blind_or_behind_a_fence(runner, state):
    async def main():
        servicer, broker = _servicer(runner)
        if state == "blind":
            servicer.link.heard_at = None
        else:
            servicer.link.fenced_until = time.monotonic() + 30
        with pytest.raises(PdError) as e:
            await servicer.Allocate(decode_pb2.AllocateRequest(request_id=b"b" * 16, num_prompt_tokens=30,
                                                               max_tokens=6), Context())
        return e.value, broker
    err, broker = asyncio.run(main())
    want = {"blind": "WATCH_BLIND", "fenced": "BROKER_FENCE"}[state]
    assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, want) and broker.calls == []


def test_a_grant_refused_by_a_moved_broker_is_retryable_and_re_registers_at_once(runner):
    async def main():
        servicer, broker = _servicer(runner)
        broker.grant_error = PdError(grpc.StatusCode.FAILED_PRECONDITION, "EPOCH_MISMATCH", "epoch 1 is not current 2")
        with pytest.raises(PdError) as e:
            await servicer.Allocate(decode_pb2.AllocateRequest(request_id=b"m" * 16, num_prompt_tokens=30,
                                                               max_tokens=6), Context())
        return e.value, servicer
    err, servicer = asyncio.run(main())
    assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, "BROKER_RESTARTED")
    assert "not current 2" in err.message
    assert servicer.link.epoch_changed.is_set() and servicer.pending_grants == set()


def test_an_allocate_whose_caller_left_during_the_grant_releases_the_leases_when_the_reply_comes(runner):
    async def main():
        servicer, broker = _servicer(runner)
        broker.gate.clear()
        task = asyncio.ensure_future(servicer.Allocate(decode_pb2.AllocateRequest(
            request_id=b"c" * 16, num_prompt_tokens=30, max_tokens=6), Context()))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        broker.gate.set()  # the broker granted after all
        await asyncio.sleep(0.05)
        return servicer, broker
    servicer, broker = asyncio.run(main())
    assert broker.named("Release") == [b"c" * 16]
    assert b"c" * 16 not in servicer.allocations and servicer.held_owners() == set()


def test_an_allocation_granted_across_a_move_to_a_new_pool_incarnation_is_never_decoded(runner):
    """The Grant was in flight when decode moved (its pool fenced at the broker): the reply's leases belong to the
    old incarnation, whose pages the new one holds quarantined and will grant again. Decoding them could read and
    write another request's KV, even with tags and checksums intact and Validate passing."""
    async def main():
        servicer, broker = _servicer(runner)
        loop = asyncio.create_task(servicer.scheduler.run())
        broker.gate.clear()
        owner, prompt = b"o" * 16, _prompt(37, 5)
        task = asyncio.ensure_future(servicer.Allocate(decode_pb2.AllocateRequest(
            request_id=owner, num_prompt_tokens=37, max_tokens=6), Context()))
        await asyncio.sleep(0.05)
        await servicer.link.move("test: pool fenced at the broker")  # same broker epoch, new pool incarnation
        servicer.link.heard_at = time.monotonic()
        broker.gate.set()
        dest = (await task).destination
        assert dest.pool_id == POOL and servicer.pool_id != POOL
        first, coverage = _prefill(runner, owner, _leases(dest), prompt)
        got, err = await _collect(servicer.Decode(decode_pb2.DecodeRequest(
            request_id=owner, num_prompt_tokens=37, first_token=first, sampling=_sampling(6), coverage=coverage),
            Context()))
        await asyncio.sleep(0.05)
        loop.cancel()
        return got, err, broker, servicer
    got, err, broker, servicer = asyncio.run(main())
    assert got == [] and err is not None and (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE,
                                                                        "BROKER_RESTARTED"), err
    assert POOL in err.message and servicer.pool_id in err.message
    assert broker.named("Validate") == []
