"""The prefix chain: which changes of a request make its pages another key (a miss), and which do not."""
import hashlib
import json
import os

import pytest

from pdserve.common.prefix import (chain_seed, chain_words, checkpoint_identity, page_chains, scope_key,
                                   scope_tag)

PS = 4


def seed(tenant="acme", salt="", scope="tenant", checkpoint=b"ck", page_size=PS, dtype="float32"):
    return chain_seed(scope_key(tenant, salt, scope), checkpoint, page_size, dtype)


def test_a_key_per_full_page_and_each_covers_every_token_before_it():
    toks = list(range(11))
    keys = page_chains(seed(), toks, PS)
    assert len(keys) == 2 and all(len(k) == 16 for k in keys)
    # an independent recomputation of the chain's definition (length-prefixed BLAKE2b-128 links)
    def link(prev, page):
        h = hashlib.blake2b(digest_size=16)
        for part in (prev, b"".join(t.to_bytes(4, "little") for t in page)):
            h.update(len(part).to_bytes(4, "little"))
            h.update(part)
        return h.digest()
    k0 = link(seed(), toks[:4])
    assert keys == [k0, link(k0, toks[4:8])]
    changed = toks[:]
    changed[1] = 99  # a token of page 0 changes page 1's key too
    assert all(a != b for a, b in zip(keys, page_chains(seed(), changed, PS)))
    assert page_chains(seed(), toks, PS, num_pages=1) == keys[:1]


def test_the_same_page_of_tokens_at_another_position_is_another_key():
    page = [5, 6, 7, 8]
    first = page_chains(seed(), page, PS)[0]
    later = page_chains(seed(), [1, 2, 3, 4] + page, PS)[1]
    assert first != later


@pytest.mark.parametrize("other", [dict(tenant="other"), dict(salt="s2"), dict(checkpoint=b"ck2"),
                                   dict(page_size=8), dict(dtype="bfloat16")])
def test_tenant_salt_checkpoint_page_size_and_dtype_each_change_every_key(other):
    toks = list(range(16))
    assert set(page_chains(seed(), toks, PS)).isdisjoint(page_chains(seed(**other), toks, 8 if "page_size" in other else PS))


def test_global_scope_shares_across_tenants_but_not_across_salts():
    assert scope_key("a", "", "global") == scope_key("b", "", "global")
    assert scope_key("a", "x", "global") != scope_key("a", "y", "global")
    assert scope_key("a", "", "tenant") != scope_key("b", "", "tenant")
    assert scope_tag(scope_key("a", "")) != scope_tag(scope_key("b", ""))
    with pytest.raises(ValueError, match="scope"):
        scope_key("a", "", "everyone")
    with pytest.raises(ValueError, match="257 bytes"):
        scope_key("a", "x" * 257)


def test_chain_words_are_the_key_as_two_signed_words():
    key = bytes(range(250, 256)) + bytes(10)
    hi, lo = chain_words(key)
    assert (hi & (2**64 - 1)).to_bytes(8, "big") + (lo & (2**64 - 1)).to_bytes(8, "big") == key


def test_checkpoint_identity_sees_a_weight_byte_at_a_sampled_offset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"a": 1}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]}}).encode()
    body = bytearray(len(header).to_bytes(8, "little") + header + bytes(4096 * 64))
    (tmp_path / "model.safetensors").write_bytes(body)
    first = checkpoint_identity(str(tmp_path))
    body[len(body) // 2] ^= 1  # offset 8/16 of the file is sampled
    (tmp_path / "model.safetensors").write_bytes(body)
    assert checkpoint_identity(str(tmp_path)) != first
    (tmp_path / "config.json").write_text(json.dumps({"a": 2}))
    assert len({first, checkpoint_identity(str(tmp_path))}) == 2
