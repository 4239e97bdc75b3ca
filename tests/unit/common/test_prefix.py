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


def _safetensors(tensor: str, body: bytes) -> bytes:
    """A safetensors file of one F32 tensor whose bytes are body."""
    header = json.dumps({tensor: {"dtype": "F32", "shape": [len(body) // 4], "data_offsets": [0, len(body)]}}).encode()
    return len(header).to_bytes(8, "little") + header + body


def _checkpoint(folder, body: bytes, config=b'{"a": 1}'):
    """config.json and a model.safetensors of one tensor."""
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_bytes(config)
    (folder / "model.safetensors").write_bytes(_safetensors("w", body))
    return str(folder)


def test_one_byte_in_the_middle_of_a_weight_file_is_another_checkpoint(tmp_path):
    # 4 MiB: a sampler of 16 x 64 KiB would see a quarter of it; the byte flipped lies between two such samples,
    # in the middle of the file (a partial fine-tune: same size, same header)
    body = bytearray(os.urandom(4 << 20))
    base = checkpoint_identity(_checkpoint(tmp_path / "base", bytes(body)))
    middle = len(body) // 2 + (1 << 16) + 4093
    body[middle] ^= 1
    tuned = checkpoint_identity(_checkpoint(tmp_path / "tuned", bytes(body)))
    assert tuned != base
    # and the identity is the files' content: an identical copy, written later (another mtime), is the same one
    body[middle] ^= 1
    copy = tmp_path / "copy"
    _checkpoint(copy, bytes(body))
    os.utime(copy / "model.safetensors", (1, 1))
    assert checkpoint_identity(str(copy)) == base
    assert checkpoint_identity(_checkpoint(tmp_path / "config", bytes(body), config=b'{"a": 2}')) != base


def test_every_shard_the_index_names_counts(tmp_path):
    shards = [os.urandom(1 << 20) for _ in range(2)]

    def write(folder, shards):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        weight_map = {}
        for i, body in enumerate(shards):
            name = f"model-{i + 1:05d}-of-00002.safetensors"
            (folder / name).write_bytes(_safetensors(f"w{i}", body))
            weight_map[f"w{i}"] = name
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        (folder / "consolidated.safetensors").write_bytes(os.urandom(64))  # not the checkpoint: ignored
        return str(folder)

    base = checkpoint_identity(write(tmp_path / "a", shards))
    assert checkpoint_identity(write(tmp_path / "b", shards)) == base
    last = bytearray(shards[1])
    last[-1] ^= 0x80
    assert checkpoint_identity(write(tmp_path / "c", [shards[0], bytes(last)])) != base


def test_prefill_and_decode_runners_of_one_checkpoint_share_the_identity(tmp_path):
    from pdserve.engine.make_model import make_model
    from pdserve.engine.runner import ModelRunner

    model_dir = str(tmp_path / "m")
    make_model(model_dir, "tiny", 0)
    # served in two dtypes (a prefill in float32, a decode in bfloat16): the files decide, not the dtype served
    a = ModelRunner(model_dir, 4, 16, dtype="float32", device="cpu")
    b = ModelRunner(model_dir, 4, 16, dtype="bfloat16", device="cpu")
    assert a.checkpoint == b.checkpoint == checkpoint_identity(model_dir)
    assert a.chain_seed(scope_key("t", "")) != b.chain_seed(scope_key("t", ""))  # the KV dtype still parts them
