"""Content-addressed prefix pages (DESIGN §9): the identity of a full KV page is a hash chain over (prefix scope,
checkpoint identity, page size, KV dtype, every token id up to the page's end). Prefill writes a page's chain key
into its tag; decode computes the chain itself from the prompt's token ids and reads a cached page only when the
keys match, so a page computed from other tokens, at another position, under another tenant or by another
checkpoint is a miss. Plain Python; BLAKE2b-128 throughout.

The scope is decided by the gateway: the tenant the caller's API key maps to and the request's cache_salt
(`--prefix-cache-scope tenant`), or the cache_salt alone (`global`, an operator's choice to share across tenants).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Sequence

import numpy as np

KEY_NBYTES = 16  # a scope or a chain key
SCOPE_TAG_NBYTES = 8
MAX_CACHE_SALT = 256  # bytes of a request's cache_salt
SCOPES = ("tenant", "global")
_SAMPLE = 1 << 16  # bytes read at each sampled offset of a weight file
# ~0.3 µs a token (~10 ms at this length): a longer prompt's keys are hashed off the event loop, at decode and prefill
CHAINS_INLINE_TOKENS = 1 << 15


def _h(*parts: bytes, size: int = KEY_NBYTES) -> bytes:
    h = hashlib.blake2b(digest_size=size)
    for p in parts:
        h.update(len(p).to_bytes(4, "little"))  # length-prefixed: ("ab", "c") and ("a", "bc") differ
        h.update(p)
    return h.digest()


def scope_key(tenant: str, cache_salt: str, scope: str = "tenant") -> bytes:
    """The prefix scope of a request: requests share cached pages only within one scope. tenant is '' when the
    gateway has no keys file (one tenant); scope 'global' leaves the tenant out, cache_salt still separates."""
    if scope not in SCOPES:
        raise ValueError(f"prefix cache scope {scope!r} is not one of {SCOPES}")
    salt = cache_salt.encode()
    if len(salt) > MAX_CACHE_SALT:
        raise ValueError(f"cache_salt is {len(salt)} bytes; at most {MAX_CACHE_SALT}")
    return _h(b"pdserve-prefix-scope-v1", scope.encode(), (tenant if scope == "tenant" else "").encode(), salt)


def scope_tag(scope: bytes) -> bytes:
    """A short fingerprint of a scope, kept by the broker with each cached page: a page is never shared with a
    reader of another fingerprint, even on a chain match (a second, independent check)."""
    check_key(scope, "prefix scope")
    return _h(b"pdserve-scope-tag-v1", scope, size=SCOPE_TAG_NBYTES)


def chain_seed(scope: bytes, checkpoint: bytes, page_size: int, kv_dtype: str) -> bytes:
    """The chain's start: everything but the tokens that decides what a page's bytes are."""
    check_key(scope, "prefix scope")
    return _h(b"pdserve-chain-v1", scope, checkpoint, page_size.to_bytes(4, "little"), kv_dtype.encode())


def page_chains(seed: bytes, token_ids: Sequence[int], page_size: int, num_pages: int | None = None) -> list[bytes]:
    """The chain key of each full page of token_ids (or of the first num_pages): key i covers tokens
    [0, (i + 1) * page_size), so a page's key names its position as well as its contents."""
    full = len(token_ids) // page_size
    n = full if num_pages is None else min(num_pages, full)
    raw = np.asarray(token_ids[:n * page_size], dtype="<i4").tobytes()
    step = page_size * 4
    keys, prev = [], seed
    for i in range(n):
        prev = _h(prev, raw[i * step:(i + 1) * step])
        keys.append(prev)
    return keys


def _s64(x: int) -> int:
    return x - (1 << 64) if x >= (1 << 63) else x


def chain_words(key: bytes) -> tuple[int, int]:
    """A chain key as the two signed int64 words of a tag."""
    check_key(key, "chain key")
    return _s64(int.from_bytes(key[:8], "big")), _s64(int.from_bytes(key[8:], "big"))


def check_key(key: bytes, what: str) -> None:
    if len(key) != KEY_NBYTES:
        raise ValueError(f"{what} must be {KEY_NBYTES} bytes, got {len(key)}")


def checkpoint_identity(model_dir: str) -> bytes:
    """What tells two checkpoints apart without reading all their weights: config.json, and per weight file its
    name, size, safetensors header (every tensor's name, dtype, shape and offsets) and 64 KiB of bytes at 16
    offsets spread over the file (a fine-tune of the same architecture changes nearly every byte)."""
    parts = []
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        parts.append(f.read())
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    for name in files:
        path = os.path.join(model_dir, name)
        size = os.path.getsize(path)
        parts += [name.encode(), size.to_bytes(8, "little")]
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            parts.append(f.read(min(header_len, size)))
            for k in range(16):
                f.seek(size * k // 16)
                parts.append(f.read(_SAMPLE))
    return _h(b"pdserve-checkpoint-v1", *parts)
