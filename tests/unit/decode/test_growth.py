"""Pages on demand in decode's scheduler (growth.py), over a real model and pool and the broker's real lease table
(its Extend answers without gRPC): a sequence granted its prompt pages plus one page of headroom grows its lease
in batched Extend calls and decodes the reference's tokens; a step never writes a page before its lease arrived;
a pool that runs dry preempts the youngest request with PREEMPTED (carrying the tokens it streamed) while the older
one completes; a growth the broker refuses (the owner revoked) ends the request with no further token."""
import asyncio

import grpc
import pytest

from pdserve.broker.lease_table import LeaseError, LeaseTable
from pdserve.common.errors import PdError
from pdserve.common.metrics import LEASE_VIOLATIONS, PREEMPTIONS
from pdserve.decode.growth import Growth
from pdserve.decode.requests import RequestTable
from pdserve.decode.scheduler import Scheduler
from pdserve.decode.sequence import Sequence
from pdserve.decode.sweep import PromptRecord
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampler import SamplingParams
from pdserve.engine.tags import GENERATION, PAGE_INDEX, expected_tags, make_tags
from tests.unit.decode.test_scheduler_steps import PS, _prompt

EPOCH = 11


@pytest.fixture(scope="module")
def runner(model_dir):
    return ModelRunner(model_dir, num_pages=40, page_size=PS, device="cpu")


class Broker:
    """The lease table behind Extend, as the servicer maps it: per item leases or a PdError with the reason."""

    def __init__(self, num_pages: int):
        self.table = LeaseTable(lock_delay_s=1.0, epoch=EPOCH, reader_ttl_s=60.0)
        self.table.register_pool("p", num_pages)
        self.calls: list[list[tuple[bytes, int]]] = []
        self.granted: dict[int, int] = {}  # page -> its generation, as the broker leased it

    async def extend(self, items):
        self.calls.append(list(items))
        await asyncio.sleep(0.01)  # a round trip: steps go on meanwhile
        out = []
        for r in self.table.extend("p", EPOCH, items):
            if isinstance(r, LeaseError):
                out.append(PdError(grpc.StatusCode.FAILED_PRECONDITION, r.reason, r.message))
            else:
                self.granted.update(r)
                out.append(r)
        return out


def _admit(runner, broker: Broker, owner_byte: int, prompt: list[int], max_tokens: int) -> Sequence:
    """Prompt pages plus one page of headroom from the broker, written the way prefill leaves them."""
    owner, pool = bytes([owner_byte]) * 16, runner.pool
    n = -(-len(prompt) // PS)
    leases = broker.table.grant("p", owner, n + 1, EPOCH)
    broker.granted.update(leases)
    pages = [p for p, _ in leases]
    logits = runner.prefill(prompt, pages[:n])
    pool.zero_tail(pages[n - 1], len(prompt) - (n - 1) * PS)
    checksums = pool.checksums(pages[:n])
    pool.tags[pages[:n]] = make_tags(owner, EPOCH, [g for _, g in leases[:n]], len(prompt), PS, checksums)
    seq = Sequence(owner, EPOCH, leases, expected_tags(owner, EPOCH, leases), len(prompt),
                   SamplingParams(max_tokens=max_tokens), frozenset(), [int(logits[-1].argmax())])
    seq.prompt = PromptRecord.of(leases, len(prompt), PS, checksums)
    seq.max_pages = -(-(len(prompt) + max_tokens - 1) // PS)
    return seq


def _scheduler(runner, broker: Broker, released: list, growth_pages: int = 2, preempt_after_s: float = 0.2):
    async def release(seq):
        released.append(seq.owner)
        broker.table.release("p", seq.owner, EPOCH)
    requests = RequestTable()
    growth = Growth(broker.extend, PS, headroom_pages=1, growth_pages=growth_pages,
                    preempt_after_s=preempt_after_s, wake=requests.wake, mark=requests.mark)
    return Scheduler(runner, release, sweep_pages=0, requests=requests, growth=growth)


async def _drain(seq: Sequence) -> tuple[list[int], PdError | None]:
    toks = list(seq.generated[:1])
    while True:
        ev = await asyncio.wait_for(seq.events.get(), 60)
        if isinstance(ev, PdError):
            return toks, ev
        toks.append(ev[0])
        if ev[1]:
            return toks, None


class Writes:
    """Wraps runner.run_decode (the step in the worker thread): records, for every step, each sequence's written
    page and whether it was leased."""

    def __init__(self, runner, broker: Broker):
        self.runner, self.run_decode, self.broker = runner, runner.run_decode, broker
        self.unleased: list[tuple[int, int]] = []
        self.steps = 0
        runner.run_decode = self

    def __call__(self, inputs):
        self.steps += 1
        for pos, table in zip(inputs.positions.tolist(), inputs.table.tolist()):
            page = table[pos // PS]
            tag = self.runner.pool.tags[page]
            # the page this step writes carries, before the step, the tag of a lease the broker gave
            if self.broker.granted.get(page) != int(tag[GENERATION]) or int(tag[PAGE_INDEX]) != pos // PS:
                self.unleased.append((page, pos))
        return self.run_decode(inputs)

    def restore(self):
        self.runner.run_decode = self.run_decode


def test_sequences_grow_their_leases_in_batches_and_decode_the_references_tokens(runner, oracle):
    async def main():
        broker, released = Broker(40), []
        s = _scheduler(runner, broker, released)
        writes = Writes(runner, broker)
        prompts = [_prompt(9 + 3 * i, seed=300 + i) for i in range(3)]
        seqs = [_admit(runner, broker, 40 + i, p, 64) for i, p in enumerate(prompts)]
        for seq in seqs:
            s.join(seq)
            s.add(seq)
        loop = asyncio.create_task(s.run())
        try:
            results = await asyncio.gather(*(_drain(q) for q in seqs))
        finally:
            loop.cancel()
            writes.restore()
        return broker, prompts, seqs, results, writes, released
    broker, prompts, seqs, results, writes, released = asyncio.run(main())
    for p, seq, (toks, err) in zip(prompts, seqs, results):
        assert err is None and len(toks) == 64
        oracle.check(p, toks)
        assert len(seq.leases) == seq.max_pages  # grown to what it used, never more
    assert writes.steps >= 63 and writes.unleased == []  # every step was seen (3 sequences, 63 steps or more)
    grown = sum(n for call in broker.calls for _, n in call)
    assert grown == sum(len(q.leases) for q in seqs) - sum(-(-len(p) // PS) + 1 for p in prompts)
    assert len(broker.calls) < sum(len(call) for call in broker.calls)  # batched: some calls grew several
    assert sorted(released) == sorted(q.owner for q in seqs)


def _two_on_seven_pages(runner, first_byte: int, seed: int, young_handed_back: int = 0):
    """7 pages: an older and a younger sequence need 5 each (6 + 70 tokens), so one must be preempted. Returns
    (prompts, sequences, (tokens, error) of each, preemptions counted, broker), the older first."""
    async def main():
        broker, released = Broker(7), []
        s = _scheduler(runner, broker, released, growth_pages=1)
        before = PREEMPTIONS._value.get()
        prompts = [_prompt(6, seed=seed), _prompt(6, seed=seed + 1)]
        seqs = [_admit(runner, broker, first_byte + i, p, 70) for i, p in enumerate(prompts)]
        seqs[1].handed_back = young_handed_back
        for seq in seqs:
            s.join(seq)
            s.add(seq)
        loop = asyncio.create_task(s.run())
        try:
            results = await asyncio.gather(*(_drain(q) for q in seqs))
        finally:
            loop.cancel()
        return prompts, seqs, results, PREEMPTIONS._value.get() - before, broker
    return asyncio.run(main())


def test_a_dry_pool_preempts_the_youngest_and_the_older_completes(runner, oracle):
    """The younger is preempted, tokens_streamed its count, and its pages let the older finish with the
    reference's tokens."""
    (old_p, _), (old, young), ((old_toks, old_err), (young_toks, young_err)), preemptions, broker = \
        _two_on_seven_pages(runner, 60, 400)
    assert old.admitted < young.admitted
    assert old_err is None and len(old_toks) == 70
    oracle.check(old_p, old_toks)
    assert young_err is not None and young_err.code == grpc.StatusCode.UNAVAILABLE
    assert young_err.reason == "PREEMPTED" and young_err.metadata == {"tokens_streamed": str(len(young_toks))}
    assert young_toks == young.generated and preemptions == 1
    assert broker.table.pool_state("p")["num_leased"] == 0


def test_a_dry_pool_spares_a_request_handed_back_before_a_younger_one_than_any_other(runner, oracle):
    """As above, but the younger was resubmitted once already (handed_back 1): the older, handed back never, is
    the victim now, and the younger completes with the reference's tokens."""
    (_, young_p), (old, young), ((old_toks, old_err), (young_toks, young_err)), preemptions, _ = \
        _two_on_seven_pages(runner, 62, 402, young_handed_back=1)
    assert old.admitted < young.admitted
    assert old_err is not None and old_err.reason == "PREEMPTED" and old_toks == old.generated
    assert young_err is None and len(young_toks) == 70 and preemptions == 1
    oracle.check(young_p, young_toks)


def revocations_counted() -> float:
    return LEASE_VIOLATIONS.labels("decode", "REVOKED")._value.get()


def test_a_growth_the_broker_refuses_ends_the_request_with_no_further_token(runner):
    async def main():
        broker, released = Broker(40), []
        s = _scheduler(runner, broker, released)
        seq = _admit(runner, broker, 70, _prompt(7, seed=500), 40)
        broker.table.revoke("p", seq.owner, "OPERATOR")  # its revocation notice has not reached decode yet
        s.join(seq)
        s.add(seq)
        before = revocations_counted()
        loop = asyncio.create_task(s.run())
        try:
            toks, err = await _drain(seq)
            await asyncio.sleep(0.05)  # the request has ended when its notice comes
            s.revoke(seq.owner, PdError(grpc.StatusCode.DATA_LOSS, "REVOKED", "the notice"))
        finally:
            loop.cancel()
        # one revocation, one violation: the refused Extend told decode first, the late notice counts nothing more
        assert revocations_counted() == before + 1
        return seq, toks, err
    seq, toks, err = asyncio.run(main())
    # the broker ended its leases (its revocation notice had not come): it ends as revoked
    assert err.code == grpc.StatusCode.DATA_LOSS and err.reason == "REVOKED"
    assert "holds no leases" in err.message and "growth pages refused" in err.message
    # it ran on its headroom page only: 7 prompt tokens + the page after them, never a page the broker refused
    assert len(seq.leases) == 2 and len(toks) <= 2 * PS - 7 + 1


def test_a_starving_sequence_that_ends_no_longer_holds_back_new_requests(runner):
    """While a running sequence lacks a page, new requests wait (running first); once it ends (cancelled, failed,
    blind) it must stop blocking them, even when nothing else runs to look again."""
    async def main():
        broker, released = Broker(2), []  # exactly its prompt page and its headroom: growth is refused
        s = _scheduler(runner, broker, released, preempt_after_s=60.0)
        seq = _admit(runner, broker, 80, _prompt(7, seed=600), 40)
        s.join(seq)
        s.add(seq)
        loop = asyncio.create_task(s.run())
        try:
            for _ in range(600):
                if s.growth.blocks_new_grants():
                    break
                await asyncio.sleep(0.05)
            starved = s.growth.blocks_new_grants()
            s.cancel(seq.owner)
            for _ in range(100):
                if released:
                    break
                await asyncio.sleep(0.05)
        finally:
            loop.cancel()
        return starved, s.growth.blocks_new_grants(), released
    starved, still, released = asyncio.run(main())
    assert starved and not still and released == [bytes([80]) * 16]


def test_a_sequence_whose_growth_is_only_in_flight_holds_back_no_one(runner, oracle):
    """Running first applies once the broker said the pool is dry: a sequence that outran its headroom while its
    Extend is still on the way (a slow broker) must not turn new requests away from a pool with pages to spare;
    once the Extend answers, it grows and completes with the reference's tokens."""
    class SlowBroker(Broker):
        def __init__(self, num_pages: int):
            super().__init__(num_pages)
            self.gate = asyncio.Event()

        async def extend(self, items):
            await self.gate.wait()
            return await super().extend(items)

    async def main():
        broker, released = SlowBroker(40), []
        s = _scheduler(runner, broker, released, preempt_after_s=60.0)
        p = _prompt(7, seed=700)
        seq = _admit(runner, broker, 90, p, 40)
        s.join(seq)
        s.add(seq)
        loop = asyncio.create_task(s.run())
        try:
            for _ in range(600):
                if s.growth.starving:
                    break
                await asyncio.sleep(0.05)
            starving, blocked = list(s.growth.starving), s.growth.blocks_new_grants()
            broker.gate.set()
            toks, err = await _drain(seq)
        finally:
            loop.cancel()
        return p, starving, blocked, toks, err
    p, starving, blocked, toks, err = asyncio.run(main())
    assert starving == [bytes([90]) * 16] and not blocked
    assert err is None and len(toks) == 40
    oracle.check(p, toks)
