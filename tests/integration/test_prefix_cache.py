"""Prefix caching through the real stack (issue 20): a conversation's turn k reads turn k-1's pages and every token
passes the oracle; two tenants with the same prompt share no page; a cached page corrupted in place is a miss and a
recompute, never output. Counts come from each service's own /metrics and the broker's pool state."""
import time

import pytest

from pdserve import launcher
from pdserve.client import build_request, generate
from tests.integration.drain_util import gateway_over
from tests.integration.helpers import prompt

PS = 16
KEYS = {"alpha": "alpha-key-0123456789", "beta": "beta-key-0123456789"}


class Tenants:
    """The package's stack (its broker, prefill and decode, whose counters the tests read) behind a second gateway
    that takes two tenants' keys: no stack of its own to start."""

    def __init__(self, stack, gateway):
        self.stack, self.gateway = stack, gateway

    def __getattr__(self, name):  # metric, arm, pool_states: the stack's
        return getattr(self.stack, name)


@pytest.fixture(scope="module")
def tenants(stack, model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text("".join(f"{t}: {k}\n" for t, k in KEYS.items()))
    gw = gateway_over(stack, model_dir, stack.procs["prefill"], stack.procs["decode"],
                      extra=("--api-keys-file", str(keys)))
    yield Tenants(stack, gw.stub)
    launcher.stop(gw)


def ask(stack, tenant: str, ids: list[int], max_tokens: int = 16, **kw) -> list[int]:
    out = generate(stack.gateway, build_request(prompt_token_ids=ids, max_tokens=max_tokens, ignore_eos=True, **kw),
                   api_key=KEYS[tenant])
    assert "error" not in out, out
    return out["token_ids"]


def hits(stack) -> float:
    return stack.metric("decode", "pdserve_prefix_cache_lookup_pages_total", {"result": "hit"})


def quiet_pool(stack, timeout: float = 15.0):
    """The pool once every request's leases and shares have ended (releases are asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        (state,) = stack.pool_states()
        if (state.num_leased == 0 and state.num_shared_reads == 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


def test_each_turn_of_a_conversation_reads_the_turn_before_and_every_token_passes_the_oracle(tenants, oracle):
    conversation = prompt(150, 2001)
    turns = []
    for k in range(4):
        before = hits(tenants)
        reply = ask(tenants, "alpha", conversation)
        got = hits(tenants) - before
        turns.append((list(conversation), reply))
        if k:
            # every full page of the turn before is cached (its prompt's own pages), and only those are full and
            # known: the reply and the new user tokens start where that prompt ended
            assert got == len(turns[-2][0]) // PS, (k, got)
        else:
            assert got == 0
        conversation += reply + prompt(24, 2100 + k)
    oracle.check_many(turns)
    state = quiet_pool(tenants)
    assert state.num_leased == 0 and state.num_shared_reads == 0 and state.num_cached > 0


def test_two_tenants_with_the_same_prompt_share_no_page(tenants, oracle):
    ids = prompt(2048, 2201)
    cross = tenants.metric("broker", "pdserve_prefix_cache_cross_scope_total", {"service": "broker"})
    refused = tenants.metric("decode", "pdserve_prefix_cache_lookup_pages_total", {"result": "refused"})
    first = ask(tenants, "alpha", ids)
    h = hits(tenants)
    again = ask(tenants, "alpha", ids)
    assert hits(tenants) - h == (len(ids) - 1) // PS  # alpha's own second request reads its pages
    h = hits(tenants)
    other = ask(tenants, "beta", ids)
    assert hits(tenants) - h == 0  # beta's scope has no page of these tokens
    h = hits(tenants)
    salted = ask(tenants, "alpha", ids, cache_salt="another conversation")
    assert hits(tenants) - h == 0  # nor alpha's under another cache_salt
    assert first == again == other == salted  # greedy, the same tokens: the same content, each computed in its scope
    oracle.check(ids, first)
    h = hits(tenants)
    ask(tenants, "beta", ids)
    assert hits(tenants) - h == (len(ids) - 1) // PS  # beta's own pages, published by its first request
    # the second, independent check: no chain match under another scope tag reached a reader
    assert tenants.metric("broker", "pdserve_prefix_cache_cross_scope_total", {"service": "broker"}) == cross
    assert tenants.metric("decode", "pdserve_prefix_cache_lookup_pages_total", {"result": "refused"}) == refused


@pytest.mark.parametrize("how, reason", [("bit_flip", "CHECKSUM"), ("foreign_tag", "TAG_CHAIN"),
                                         ("stale_generation", "TAG_GENERATION"), ("late_write", "CHECKSUM")])
def test_a_cached_page_corrupted_in_place_is_a_miss_and_a_recompute(tenants, oracle, how, reason):
    ids = prompt(100, 2300 + len(how))
    first = ask(tenants, "alpha", ids)
    refused = tenants.metric("decode", "pdserve_prefix_cache_refused_total", {"reason": reason})
    h = hits(tenants)
    tenants.arm("decode", "decode.corrupt_cached", arg=how)
    again = ask(tenants, "alpha", ids)
    assert tenants.metric("decode", "pdserve_prefix_cache_refused_total", {"reason": reason}) == refused + 1
    # page 0 was the corrupted one: nothing of this prompt is read from the cache, prefill wrote every page
    assert hits(tenants) - h == 0
    assert again == first
    oracle.check(ids, again)
    state = quiet_pool(tenants)
    assert state.num_leased == 0 and state.num_shared_reads == 0
    # the bad page left the cache; this request's own pages took its place, so the next one reads them
    h = hits(tenants)
    assert ask(tenants, "alpha", ids) == first
    assert hits(tenants) - h == (len(ids) - 1) // PS
