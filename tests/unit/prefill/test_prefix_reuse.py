"""Prefill's servicer with the real runner on the tiny model, a loopback transport (memmove into a destination pool)
and a broker that says yes: the tags of a write under a prefix scope and after a destination's cached pages, the
forward pass that skips a prefix cached locally (counted at the runner) with the first token and page bytes of a
cold run, a changed cached page recomputed, scopes kept apart, and a failed write that leaves nothing cached."""
import asyncio
import ctypes
import time
from types import SimpleNamespace

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from pdserve.common.errors import PdError
from pdserve.common.prefix import chain_seed, chain_words, checkpoint_identity, page_chains, scope_key
from pdserve.common.proto import broker_pb2, common_pb2, prefill_pb2
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.runner import ModelRunner
from pdserve.engine.tags import (CHAIN_HI, CHAIN_LO, GENERATION, NUM_TOKENS, OWNER_HI, OWNER_LO, PAGE_INDEX,
                                 owner_words, page_checksum)
from pdserve.kvtransfer.engine import TransferError
from pdserve.prefill.servicer import PrefillServicer
from pdserve.prefill.worker import PrefillWorker

PS, LOCAL_PAGES, HOLD_S = 16, 64, 0.3
S, T = scope_key("tenant-a", ""), scope_key("tenant-b", "")


class Loopback:
    """The transport: every run is copied at once; fail_stage makes that stage's call land, then report failure."""

    def __init__(self):
        self.fail_stage = None

    def register(self, ptr, nbytes):
        pass

    def write(self, session, runs, stage, owner=b""):
        for r in runs:
            ctypes.memmove(r.dst, r.src, r.nbytes)
        if stage == self.fail_stage:
            raise TransferError(stage, "loopback: the batch call reported failure")
        return sum(r.nbytes for r in runs)


class YesLeases:
    writer_prefix, max_landing_s, liveness_margin_s, rpc_timeout_s = "prefill/p0/1", HOLD_S, 0.1, 1.0

    def __init__(self, region):
        self.region, self.acks = region, []

    async def begin(self, pool_id, owner, epoch, leases_pb, writer_id, deadline=None):
        return [time.monotonic() + 60], SimpleNamespace(cancel=lambda: None), self.region

    async def end(self, pool_id, owner, epoch, leases_pb, writer_id, ok, nothing_posted, coverage=None, first_token=0,
                  prompt_digest=b""):
        self.acks.append((owner, ok))


class Counting:
    """Wraps runner.prefill_batch: the (start, tokens) of every chunk the model computed."""

    def __init__(self, runner):
        self.inner, self.chunks = runner.prefill_batch, []

    def __call__(self, chunks):
        self.chunks += [(c.start, len(c.token_ids)) for c in chunks]
        return self.inner(chunks)


@pytest.fixture(scope="module")
def runners(model_dir):
    """Two engines, so the cold reference never touches the pages the warm one caches."""
    return [ModelRunner(model_dir, num_pages=LOCAL_PAGES, page_size=PS, device="cpu") for _ in range(2)]


class Stack:
    def __init__(self, runner, cache: bool, monkeypatch):
        self.transfer = Loopback()
        self.worker = PrefillWorker(runner, self.transfer, prefix_cache=cache)
        self.counting = Counting(runner)
        monkeypatch.setattr(runner, "prefill_batch", self.counting)
        self.dest = KVPool(runner.layout, 32)
        self.region = broker_pb2.PoolRegion(transfer_session="d:1", data_base=self.dest.data_ptr,
                                            tag_base=self.dest.tag_ptr)
        self.leases = None
        self.servicer = None

    def start(self):
        """In the running loop: the servicer's queue belongs to it."""
        self.leases = YesLeases(self.region)
        self.servicer = PrefillServicer(self.worker, self.leases, context_length=1024, max_prompt=LOCAL_PAGES * PS,
                                        model_name="tiny")
        self.region.layout.CopyFrom(self.servicer.layout_pb)
        return self

    async def prefill(self, owner: int, tokens, dest_pages, scope=S, cached=0, prompt_logprobs=None, gen=1):
        req = prefill_pb2.PrefillRequest(
            request_id=bytes([owner]) * 16, token_ids=tokens, prefix_scope=scope,
            sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0, top_p=1.0, logprobs=3),
            destination=common_pb2.Destination(
                pool_id="decode/d0/x", transfer_session="d:1", data_base=self.dest.data_ptr,
                tag_base=self.dest.tag_ptr, epoch=9, layout=self.servicer.layout_pb, cached_pages=cached,
                leases=[common_pb2.PageLease(page=p, generation=gen + i) for i, p in enumerate(dest_pages)]))
        if prompt_logprobs is not None:
            req.prompt_logprobs = prompt_logprobs
        self.counting.chunks.clear()
        return await self.servicer.Prefill(req, None)

    def computed(self) -> list[tuple[int, int]]:
        return list(self.counting.chunks)


def prompt(n: int, salt: int = 1) -> list[int]:
    return [(salt * 131 + 17 * i + i * i) % 509 + 2 for i in range(n)]


def metric(name: str) -> float:
    return REGISTRY.get_sample_value(f"pdserve_prefill_prefix_{name}") or 0.0


def chains_of(model_dir, runner, scope, tokens) -> list[tuple[int, int]]:
    """The chain words of each full page, computed from the pieces (not through the runner)."""
    seed = chain_seed(scope, checkpoint_identity(model_dir), PS, runner.kv_dtype)
    return [chain_words(k) for k in page_chains(seed, tokens, PS)]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_tags_from_the_destinations_cached_pages_on_carry_their_index_tokens_and_chain(runners, model_dir,
                                                                                       monkeypatch):
    warm = Stack(runners[0], True, monkeypatch)
    tokens = prompt(83)  # 5 full pages and 3 tokens

    async def main():
        warm.start()
        resp = await warm.prefill(1, tokens, [10, 11, 12, 13], cached=2, gen=5)
        bare = await warm.prefill(2, tokens, [20, 21, 22, 23], scope=b"", cached=2, gen=5)
        return resp, bare

    resp, bare = asyncio.run(main())
    cov = resp.coverage
    assert (cov.num_tokens, cov.num_pages) == (83 - 2 * PS, 4)  # only what was written
    assert list(cov.checksums) == [page_checksum(warm.dest.kv[p]) for p in (10, 11, 12, 13)]
    tags = warm.dest.tags[[10, 11, 12, 13]]
    hi, lo = owner_words(bytes([1]) * 16)
    assert tags[:, OWNER_HI].tolist() == [hi] * 4 and tags[:, OWNER_LO].tolist() == [lo] * 4
    assert tags[:, PAGE_INDEX].tolist() == [2, 3, 4, 5]
    assert tags[:, NUM_TOKENS].tolist() == [16, 16, 16, 3]
    assert tags[:, GENERATION].tolist() == [5, 6, 7, 8]
    want = chains_of(model_dir, runners[0], S, tokens)
    assert len(want) == 5
    assert [tuple(r) for r in tags[:, CHAIN_HI:CHAIN_LO + 1].tolist()] == want[2:5] + [(0, 0)]  # partial page: 0
    no_scope = warm.dest.tags[[20, 21, 22, 23]]
    assert no_scope[:, PAGE_INDEX].tolist() == [2, 3, 4, 5] and not no_scope[:, CHAIN_HI:CHAIN_LO + 1].any()
    assert bare.coverage.num_tokens == 51
    # the bytes are prompt pages 2..5 of one whole forward pass
    ref = runners[1]
    ref.prefill(tokens, list(range(6)))
    ref.pool.zero_tail(5, 3)
    for i, p in enumerate((10, 11, 12, 13)):
        assert torch.equal(warm.dest.kv[p], ref.pool.kv[2 + i])
    # the full pages this prefill computed under the scope are cached, the two decode had included
    assert warm.worker.cache.num_cached == 5


def test_admission_checks_the_scope_and_the_cached_pages_with_the_numbers(runners, monkeypatch):
    warm = Stack(runners[0], True, monkeypatch)

    async def refused(**kw):
        with pytest.raises(PdError) as info:
            await warm.prefill(1, **kw)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        return info.value.reason, info.value.message

    async def main():
        warm.start()
        assert await refused(tokens=prompt(20), dest_pages=[0, 1], scope=b"x" * 5) == (
            "BAD_PREFIX_SCOPE", "prefix_scope must be 16 bytes or empty, got 5")
        # 32 tokens: the second page holds the last token, so at most 1 page can be cached
        assert await refused(tokens=prompt(32), dest_pages=[0], cached=2) == (
            "BAD_DESTINATION", "destination has 2 cached pages; a prompt of 32 tokens in pages of 16 has at most 1")
        assert await refused(tokens=prompt(40), dest_pages=[0], cached=1) == (
            "BAD_DESTINATION", "prompt is 40 tokens (3 pages, 1 cached); destination leases 1 pages, 2 needed")
        assert warm.computed() == [] and warm.leases.acks == []  # refused before anything ran or was asked

    asyncio.run(main())


def test_a_locally_cached_prefix_is_not_computed_again_and_the_result_is_a_cold_runs(runners, model_dir,
                                                                                     monkeypatch):
    warm, cold = Stack(runners[0], True, monkeypatch), Stack(runners[1], False, monkeypatch)
    first, turn2 = prompt(83), prompt(83) + prompt(32, salt=2)  # a conversation that grew by 32 tokens
    hits, misses = metric("hit_pages_total"), metric("miss_pages_total")

    async def main():
        warm.start(), cold.start()
        await warm.prefill(1, first, list(range(6)))
        assert warm.computed() == [(0, 83)]
        cached = warm.worker.cache.match(page_chains(runners[0].chain_seed(S), first, PS))
        assert len(cached) == 5
        got = await warm.prefill(2, turn2, list(range(8, 16)))
        assert warm.computed() == [(5 * PS, 115 - 5 * PS)]  # the suffix alone, after the cached pages' KV
        ref = await cold.prefill(2, turn2, list(range(8, 16)))
        assert cold.computed() == [(0, 115)]
        other = await warm.prefill(3, turn2, list(range(16, 24)), scope=T)  # another tenant: nothing shared
        assert warm.computed() == [(0, 115)]
        # decode holds all but the last page: only that is written, and only its 3 tokens are computed
        last = await warm.prefill(4, turn2, [30], cached=7)
        assert warm.computed() == [(7 * PS, 3)]
        return cached, got, ref, other, last

    cached, got, ref, other, last = asyncio.run(main())
    assert metric("hit_pages_total") - hits == 5 + 7 and metric("miss_pages_total") - misses == 5 + 2 + 7 + 0
    for resp in (got, other, last):
        assert resp.first_token == ref.first_token
        assert list(resp.first_logprobs.top_token_ids) == list(ref.first_logprobs.top_token_ids)
        assert abs(resp.first_logprobs.logprob - ref.first_logprobs.logprob) < 1e-4
    # the pages decode receives: the first 5 are the cached pages' bytes exactly (copies); all 8 are a cold pass's
    # up to float noise (bit-identical on one CPU thread; with two, matmuls over 83 and 115 rows split differently:
    # up to 3.4e-6 on values up to 7.5)
    for i, p in enumerate(range(8, 13)):
        assert torch.equal(warm.dest.kv[p], warm.worker.pool.kv[cached[i]])
    for p in range(8, 16):
        assert close(warm.dest.kv[p], cold.dest.kv[p])
    assert list(got.coverage.checksums) == [page_checksum(warm.dest.kv[p]) for p in range(8, 16)]
    tags = warm.dest.tags[8:16]
    assert tags[:, PAGE_INDEX].tolist() == list(range(8)) and tags[:, NUM_TOKENS].tolist() == [16] * 7 + [3]
    assert [tuple(r) for r in tags[:, CHAIN_HI:CHAIN_LO + 1].tolist()] == chains_of(
        model_dir, runners[0], S, turn2) + [(0, 0)]
    assert warm.dest.tags[30, PAGE_INDEX].item() == 7 and warm.dest.tags[30, NUM_TOKENS].item() == 3
    # a cached page's tag row is never this request's: it still holds the tag its own writer gave it
    hi, lo = owner_words(bytes([1]) * 16)
    assert warm.worker.pool.tags[cached, OWNER_HI].tolist() == [hi] * 5
    assert warm.worker.pool.tags[cached, OWNER_LO].tolist() == [lo] * 5
    # pages 5 and 6 of the second turn joined the cache; tenant b's 7 full pages are its own
    assert warm.worker.cache.num_cached == 5 + 2 + 7 and warm.worker.cache.num_idle == 14
    assert warm.worker.alloc.num_free == LOCAL_PAGES - 14


def test_a_cached_page_whose_bytes_changed_is_recomputed(runners, monkeypatch):
    warm, cold = Stack(runners[0], True, monkeypatch), Stack(runners[1], False, monkeypatch)
    tokens = prompt(83, salt=3)
    corrupt = metric("corrupt_pages_total")

    async def main():
        warm.start(), cold.start()
        await warm.prefill(1, tokens, list(range(6)))
        page = warm.worker.cache.match(page_chains(runners[0].chain_seed(S), tokens, PS))[2]
        warm.worker.pool.kv[page].view(torch.uint8).view(-1)[79] ^= 0x40  # an exponent bit of one value flips
        got = await warm.prefill(2, tokens, list(range(8, 14)))
        assert warm.computed() == [(2 * PS, 83 - 2 * PS)]  # pages 2.. recomputed, not read
        ref = await cold.prefill(2, tokens, list(range(8, 14)))
        return got, ref

    got, ref = asyncio.run(main())
    assert metric("corrupt_pages_total") - corrupt == 1
    assert got.first_token == ref.first_token
    assert abs(got.first_logprobs.logprob - ref.first_logprobs.logprob) < 1e-4
    for p in range(8, 14):  # page 2 (dest page 10) too: recomputed, the flipped value is nowhere
        assert close(warm.dest.kv[p], cold.dest.kv[p])


def test_prompt_logprobs_need_every_position_so_such_a_prompt_runs_whole(runners, monkeypatch):
    warm, cold = Stack(runners[0], True, monkeypatch), Stack(runners[1], False, monkeypatch)
    tokens = prompt(70, salt=4)

    async def main():
        warm.start(), cold.start()
        await warm.prefill(1, tokens, list(range(5)))
        got = await warm.prefill(2, tokens, list(range(8, 13)), prompt_logprobs=2)
        assert warm.computed() == [(0, 70)]
        return got, await cold.prefill(2, tokens, list(range(8, 13)), prompt_logprobs=2)

    got, ref = asyncio.run(main())
    assert got.first_token == ref.first_token and len(got.prompt_logprobs) == len(ref.prompt_logprobs) == 69
    for a, b in zip(got.prompt_logprobs, ref.prompt_logprobs):
        assert list(a.top_token_ids) == list(b.top_token_ids) and abs(a.logprob - b.logprob) < 1e-4


@pytest.mark.parametrize("stage", ["data", "tags"])
def test_a_failed_write_puts_no_page_in_the_cache(runners, monkeypatch, stage):
    warm = Stack(runners[0], True, monkeypatch)
    tokens = prompt(83, salt=5)

    async def main():
        warm.start()
        warm.transfer.fail_stage = stage
        with pytest.raises(PdError) as info:
            await warm.prefill(1, tokens, list(range(6)))
        failed = time.monotonic()
        assert info.value.reason == "TRANSFER_FAILED" and warm.leases.acks == [(bytes([1]) * 16, False)]
        assert warm.worker.cache.num_cached == 0  # its pages wait out the landing bound, in no cache
        held = LOCAL_PAGES - warm.worker.alloc.num_free
        assert held == 6 or time.monotonic() - failed >= HOLD_S
        warm.transfer.fail_stage = None
        await warm.prefill(2, tokens, list(range(8, 14)))
        assert warm.computed() == [(0, 83)]  # nothing of the failed write was reused
        assert warm.worker.cache.num_cached == 5
        while warm.worker.alloc.num_free + warm.worker.cache.num_idle < LOCAL_PAGES:
            assert time.monotonic() - failed < HOLD_S + 5, "the failed write's pages never came back"
            await asyncio.sleep(0.02)

    asyncio.run(main())
