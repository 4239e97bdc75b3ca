"""Decode's check of the cached pages a Grant shares, and of the chain words on the pages prefill wrote: every way
a cached page can be not this request's KV is refused before a read (a miss), naming the page and the reason."""
import pytest
import torch

from pdserve.common.errors import PdError
from pdserve.common.prefix import chain_seed, page_chains, scope_key
from pdserve.common.wire import prompt_digest
from pdserve.decode.reuse import first_bad_shared, plan_prefix, shared_words
from pdserve.decode.verify import Violation, verify_prompt_pages
from pdserve.engine.kv_pool import KVPool, PoolLayout
from pdserve.engine.tags import CHAIN_HI, EPOCH, GENERATION, OWNERSHIP, make_tags

PS, EPOCH_ID, VOCAB = 4, 0xE1, 1000
PUBLISHER, READER = b"P" * 16, b"R" * 16
TOKENS = [7, 1, 2, 3, 9, 9, 8, 4, 5, 6, 11, 12, 13]  # 3 full pages and a partial one


def seed_of(scope):
    return chain_seed(scope, b"checkpoint", PS, "float32")


SCOPE = scope_key("acme", "")
CHAINS = page_chains(seed_of(SCOPE), TOKENS, PS)


def published_pool(pages=(5, 2, 9), gens=(3, 3, 3)):
    """A pool whose pages hold a publisher's first len(pages) full prompt pages, as prefill tagged them."""
    pool = KVPool(PoolLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=PS, dtype="float32"), 12)
    torch.manual_seed(0)
    pool.kv.copy_(torch.randn_like(pool.kv))
    sums = pool.checksums(list(pages))
    pool.tags[list(pages)] = make_tags(PUBLISHER, EPOCH_ID, list(gens), PS * len(pages), PS, sums,
                                       chains=CHAINS[:len(pages)])
    return pool, [(p, g) for p, g in zip(pages, gens)], sums


def test_the_publishers_pages_pass_for_a_reader_of_the_same_tokens_and_scope():
    pool, leases, sums = published_pool()
    assert first_bad_shared(pool, EPOCH_ID, leases, CHAINS, sums) is None
    words = shared_words(pool, leases)  # what the per-step check then expects: the publisher's tags as checked
    assert torch.equal(words, pool.tags[[5, 2, 9]][:, OWNERSHIP])


@pytest.mark.parametrize("harm, want", [
    ("bit_flip", (1, "CHECKSUM")),
    ("other_scope", (0, "TAG_CHAIN")),
    ("stale_generation", (2, "TAG_GENERATION")),
    ("other_epoch", (0, "TAG_EPOCH")),
    ("no_tag", (1, "TAG_MISSING")),
    ("recorded_checksum", (2, "CHECKSUM")),
])
def test_a_cached_page_that_is_not_provably_this_chain_is_refused(harm, want):
    pool, leases, sums = published_pool()
    chains = CHAINS
    if harm == "bit_flip":  # bytes changed in place; the tag still claims the old checksum
        pool.kv[2].view(torch.uint8).view(-1)[17] ^= 0x04
    elif harm == "other_scope":  # the same tokens under another tenant: every key differs
        chains = page_chains(seed_of(scope_key("other", "")), TOKENS, PS)
    elif harm == "stale_generation":  # the broker's lease is newer than what the tag was written under
        leases[2] = (9, 4)
    elif harm == "other_epoch":
        pool.tags[5, EPOCH] = 0xE2
    elif harm == "no_tag":
        pool.tags[2] = 0
    elif harm == "recorded_checksum":  # bytes and tag agree, the broker recorded other bytes when published
        sums = [*sums[:2], sums[2] ^ 1]
    got = first_bad_shared(pool, EPOCH_ID, leases, chains, sums)
    assert got is not None and got[:2] == want, got
    assert f"cached prompt page {want[0]}" in got[2]


def test_the_same_page_of_tokens_at_another_offset_is_refused():
    pool, leases, sums = published_pool()
    # a reader whose prompt starts with the publisher's second page: its page 0 has those tokens, at offset 0
    shifted = TOKENS[PS:]
    mine = page_chains(seed_of(SCOPE), shifted, PS)
    got = first_bad_shared(pool, EPOCH_ID, leases[1:2], mine, sums[1:2])
    assert got is not None and got[1] in ("TAG_PAGE_INDEX", "TAG_CHAIN")


def test_the_check_costs_no_page_bytes_when_told_not_to_but_still_reads_tags():
    pool, leases, sums = published_pool()
    pool.kv[2].view(torch.uint8).view(-1)[0] ^= 1
    assert first_bad_shared(pool, EPOCH_ID, leases, CHAINS, sums, check_bytes=False) is None
    pool.tags[2, CHAIN_HI] ^= 1
    assert first_bad_shared(pool, EPOCH_ID, leases, CHAINS, sums, check_bytes=False)[:2] == (1, "TAG_CHAIN")


def test_pages_prefill_wrote_after_the_cached_ones_carry_the_chain_from_their_index_on():
    pool = KVPool(PoolLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=PS, dtype="float32"), 12)
    pool.kv.copy_(torch.randn_like(pool.kv))
    leases = [(5, 3), (2, 3), (0, 8), (1, 8)]  # two shared pages, then this reader's own two
    own = [0, 1]
    sums = pool.checksums(own)
    n = len(TOKENS)
    pool.tags[own] = make_tags(READER, EPOCH_ID, [8, 8], n - 2 * PS, PS, sums, first_index=2, chains=CHAINS[2:3])
    verify_prompt_pages(pool, READER, EPOCH_ID, leases, n, n - 2 * PS, sums, first=2, chains=CHAINS)
    with pytest.raises(Violation) as e:  # coverage of the whole prompt when two pages were cached
        verify_prompt_pages(pool, READER, EPOCH_ID, leases, n, n, sums, first=2, chains=CHAINS)
    assert e.value.reason == "COVERAGE_MISMATCH"
    other = page_chains(seed_of(scope_key("acme", "salt")), TOKENS, PS)
    with pytest.raises(Violation) as e:  # prefill computed them under another scope (or from other tokens)
        verify_prompt_pages(pool, READER, EPOCH_ID, leases, n, n - 2 * PS, sums, first=2, chains=other)
    assert e.value.reason == "TAG_CHAIN" and "prompt page 2" in e.value.message
    pool.tags[0, GENERATION] = 7
    with pytest.raises(Violation) as e:
        verify_prompt_pages(pool, READER, EPOCH_ID, leases, n, n - 2 * PS, sums, first=2, chains=CHAINS)
    assert e.value.reason == "TAG_GENERATION" and "prompt page 2" in e.value.message


def test_a_plan_looks_up_every_full_page_but_the_one_of_the_last_prompt_token():
    digest = prompt_digest(TOKENS)
    plan = plan_prefix(SCOPE, TOKENS, len(TOKENS), digest, VOCAB, seed_of, PS, True)
    assert plan.chains == CHAINS and plan.lookup == CHAINS[:3]
    exact = TOKENS[:12]  # 3 full pages: the third holds the last token, so it is written, never shared
    plan = plan_prefix(SCOPE, exact, 12, prompt_digest(exact), VOCAB, seed_of, PS, True)
    assert len(plan.chains) == 3 and len(plan.lookup) == 2
    assert plan_prefix(SCOPE, TOKENS, len(TOKENS), digest, VOCAB, seed_of, PS, False).lookup == []
    assert plan_prefix(b"", TOKENS, len(TOKENS), digest, VOCAB, seed_of, PS, True) is None


@pytest.mark.parametrize("case, reason", [("short_scope", "BAD_PREFIX_SCOPE"), ("missing_ids", "BAD_PROMPT_IDS"),
                                          ("other_ids", "BAD_PROMPT_IDS"), ("out_of_vocab", "TOKEN_OUT_OF_VOCAB")])
def test_a_plan_refuses_what_would_make_the_chain_not_the_prompts(case, reason):
    scope, ids, digest = SCOPE, TOKENS, prompt_digest(TOKENS)
    if case == "short_scope":
        scope = SCOPE[:8]
    elif case == "missing_ids":
        ids = []
    elif case == "other_ids":  # the ids decode would hash are not the prompt prefill computes
        ids = [*TOKENS[:-1], 3]
    else:
        ids = [*TOKENS[:-1], VOCAB]
        digest = prompt_digest(ids)
    with pytest.raises(PdError) as e:
        plan_prefix(scope, ids, len(TOKENS), digest, VOCAB, seed_of, PS, True)
    assert e.value.reason == reason
