"""Decode guards that no test used to fail without (issue 18, point 8: a mutation pass over decode's checks).

Over a real model and pool: a sequence that fails the per-step tag check or the checksum sweep is ended before
the step and never stepped, so the step neither reads the suspect page nor writes the sequence's next K/V into a
page someone else may own now, while the rest of the batch is stepped and passes the oracle. Without a model:
the first error a sequence is marked with is the one it reports, a Release of an owner that is running is never
sent to the broker, and canary mode finds a freed page's marker in a verified prompt page."""
import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest
import torch

from pdserve.common.errors import PdError
from pdserve.common.metrics import CANARY_HITS, LEASE_VIOLATIONS
from pdserve.decode.scheduler import Scheduler, Sequence, raise_if_ended
from pdserve.decode.verify import CANARY_BYTE, Violation, check_canaries
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampler import SamplingParams
from pdserve.engine.tags import OWNER_LO, expected_tags
from tests.unit.decode.tagged import EPOCH_, LEASES, NUM_PROMPT, OWNER, make_pool, write_pages
from tests.unit.decode.test_scheduler_steps import PS, _admit, _drain, _greedy, _prompt
from tests.unit.decode.test_step_lifetime import Gate

REVOKED = PdError(grpc.StatusCode.DATA_LOSS, "REVOKED", "the broker revoked this request's leases: OPERATOR")
BLIND = PdError(grpc.StatusCode.UNAVAILABLE, "WATCH_BLIND", "decode has not heard from the stream for 2.00s")


@pytest.fixture(scope="module")
def runner(model_dir):
    return ModelRunner(model_dir, num_pages=96, page_size=PS, device="cpu")


def _three(runner, max_tokens: int) -> tuple[list[list[int]], list[Sequence]]:
    # prompts end mid-page: every step writes the new token's K/V into the last prompt page
    prompts = [_prompt(37, 31), _prompt(21, 32), _prompt(50, 33)]
    seqs, page = [], 0
    for i, p in enumerate(prompts):
        seqs.append(_admit(runner, 40 + i, p, page, max_tokens, _greedy(max_tokens)))
        page += len(seqs[-1].leases)
    return prompts, seqs


def _run_batch(runner, seqs: list[Sequence], sweep_pages: int, spoil) -> tuple[list, list, Gate]:
    """Runs the batch to its end with `spoil` applied after admission, before the first step."""
    async def main():
        released = []

        async def release(seq):
            released.append(seq.owner)
        s = Scheduler(runner, release, sweep_pages=sweep_pages)
        for seq in seqs:
            s.join(seq)
            s.add(seq)
        spoil()
        gate = Gate(runner)
        loop = asyncio.create_task(s.run())
        try:
            out = await asyncio.wait_for(asyncio.gather(*(_drain(q) for q in seqs)), 120)
        finally:
            loop.cancel()
            gate.restore()
        await asyncio.sleep(0)
        return out, released, gate
    return asyncio.run(main())


def _assert_never_stepped(runner, victim: Sequence, gate: Gate, kv_before: torch.Tensor, others: list[Sequence]):
    stepped = [firsts for firsts in gate.batches if victim.pages[0] in firsts]
    assert stepped == [], f"the failed sequence was stepped {len(stepped)} times after it failed its check"
    # no K/V of a next token went into its pages: they may belong to whoever overwrote them
    assert torch.equal(runner.pool.kv[victim.pages], kv_before)
    assert gate.batches and all(sorted(firsts) == sorted(q.pages[0] for q in others) for firsts in gate.batches)


def test_a_sequence_whose_tag_no_longer_matches_is_never_stepped_and_the_rest_of_the_batch_is(runner, oracle):
    max_tokens = 6
    prompts, seqs = _three(runner, max_tokens)
    victim = seqs[1]
    before = LEASE_VIOLATIONS.labels("decode", "STEP_TAG_MISMATCH")._value.get()
    kv = {}

    def overwrite_tag():  # another writer's tag landed on the victim's first prompt page, after verification
        runner.pool.tags[victim.pages[0], OWNER_LO] ^= 1
        kv["before"] = runner.pool.kv[victim.pages].clone()
    results, released, gate = _run_batch(runner, seqs, 0, overwrite_tag)
    toks, err = results[1]
    assert err is not None and (err.code, err.reason) == (grpc.StatusCode.DATA_LOSS, "STEP_TAG_MISMATCH"), err
    assert toks == victim.generated[:1]  # the first token, sent before it ran; nothing computed after
    assert LEASE_VIOLATIONS.labels("decode", "STEP_TAG_MISMATCH")._value.get() == before + 1
    _assert_never_stepped(runner, victim, gate, kv["before"], [seqs[0], seqs[2]])
    for i in (0, 2):
        toks, err = results[i]
        assert err is None and len(toks) == max_tokens
        oracle.check(prompts[i], toks)
    assert sorted(released) == sorted(q.owner for q in seqs)


def test_a_sequence_whose_prompt_bytes_changed_is_never_stepped_and_the_rest_of_the_batch_is(runner, oracle):
    max_tokens = 6
    prompts, seqs = _three(runner, max_tokens)
    victim = seqs[2]
    before = LEASE_VIOLATIONS.labels("decode", "PROMPT_PAGE_CHANGED")._value.get()
    kv = {}

    def late_data_write():  # data alone, no tag: only the sweep can see it (budget: every page at the first step)
        runner.pool.kv[victim.pages[1], 1, 0, 2] += 0.25
        kv["before"] = runner.pool.kv[victim.pages].clone()
    results, released, gate = _run_batch(runner, seqs, 64, late_data_write)
    toks, err = results[2]
    assert err is not None and (err.code, err.reason) == (grpc.StatusCode.DATA_LOSS, "PROMPT_PAGE_CHANGED"), err
    assert "prompt page 1" in err.message and f"physical page {victim.pages[1]}" in err.message
    assert toks == victim.generated[:1]
    assert LEASE_VIOLATIONS.labels("decode", "PROMPT_PAGE_CHANGED")._value.get() == before + 1
    _assert_never_stepped(runner, victim, gate, kv["before"], seqs[:2])
    for i in (0, 1):
        toks, err = results[i]
        assert err is None and len(toks) == max_tokens
        oracle.check(prompts[i], toks)
    assert sorted(released) == sorted(q.owner for q in seqs)


LEASES2 = [(3, 1), (4, 1)]


def _seq(owner: bytes) -> Sequence:
    return Sequence(owner, 7, LEASES2, expected_tags(owner, 7, LEASES2), 5, SamplingParams(max_tokens=8),
                    frozenset(), [1])


def test_the_first_error_a_sequence_is_marked_with_is_the_one_it_reports():
    """A revoked request that the gateway then releases (or that a later outage fails) must still end as REVOKED:
    DATA_LOSS, not to be retried, with the broker's reason; the later mark may not overwrite or erase it."""
    async def main():
        released = []

        async def release(seq):
            released.append(seq.owner)
        s = Scheduler(runner=None, release=release, blind=lambda: None)
        joining, running = _seq(b"j" * 16), _seq(b"r" * 16)
        s.join(joining)
        s.join(running)
        s.add(running)
        for seq in (joining, running):
            s.revoke(seq.owner, REVOKED)
        s.cancel(joining.owner)  # the client's Release arrives after the revocation
        s.fail_all(BLIND)
        with pytest.raises(PdError) as e:
            raise_if_ended(joining)
        assert e.value is REVOKED and "OPERATOR" in e.value.message
        loop = asyncio.create_task(s.run())  # ends the marked running sequence between steps (runner unused)
        try:
            ev = await asyncio.wait_for(running.events.get(), 5)
        finally:
            loop.cancel()
        assert ev is REVOKED and running.generated == [1]
        await asyncio.sleep(0)
        assert released == [running.owner]
    asyncio.run(main())


def test_decode_never_sends_a_release_for_an_owner_its_scheduler_is_running(model_dir):
    """Defence in depth for hole 1 (the lead's test covers a joining owner): a running owner's pages are read and
    written at every step, so a Release of it, from whatever path, must stop it instead of reaching the broker."""
    from pdserve.decode.servicer import DecodeServicer

    class Broker:
        def __init__(self):
            self.released = []

        def Release(self, req, timeout):
            self.released.append(req.owner)

            async def answer():
                return SimpleNamespace()
            return answer()

    async def main():
        broker = Broker()
        servicer = DecodeServicer(ModelRunner(model_dir, num_pages=8, page_size=16, device="cpu"), broker,
                                  "decode/d0/p", "session", 4096, "tiny", max_blind_s=600.0)
        servicer.link.heard_at = time.monotonic()  # the revocation stream is up
        owner = b"r" * 16
        seq = _seq(owner)
        servicer.scheduler.join(seq)
        servicer.scheduler.add(seq)
        before = LEASE_VIOLATIONS.labels("decode", "RELEASE_WHILE_HELD")._value.get()
        await servicer.release(owner, 7, LEASES2)
        assert broker.released == []
        assert seq.cancelled and (seq.err.code, seq.err.reason) == (grpc.StatusCode.INTERNAL, "RELEASE_WHILE_HELD")
        assert servicer.scheduler.running.get(owner) is seq and not seq.done  # the loop ends it between steps
        assert LEASE_VIOLATIONS.labels("decode", "RELEASE_WHILE_HELD")._value.get() == before + 1
    asyncio.run(main())


def test_canary_mode_refuses_a_verified_prompt_page_that_still_carries_a_freed_pages_marker():
    pool = make_pool()
    write_pages(pool, OWNER, EPOCH_, LEASES, NUM_PROMPT)
    check_canaries(pool, LEASES, NUM_PROMPT)  # written pages carry no marker
    pool.fill([LEASES[3][0]], CANARY_BYTE)  # decode's own page, not yet written: not a prompt page
    check_canaries(pool, LEASES, NUM_PROMPT)
    page = LEASES[2][0]
    pool.kv[page, 1, 0, 1].view(torch.uint8)[:4] = CANARY_BYTE  # one stale float left in the last prompt page
    before = CANARY_HITS._value.get()
    with pytest.raises(Violation) as e:
        check_canaries(pool, LEASES, NUM_PROMPT)
    assert e.value.reason == "CANARY" and f"prompt page 2 (physical page {page})" in e.value.message
    assert CANARY_HITS._value.get() == before + 1
