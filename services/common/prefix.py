"""Content-addressed prefix pages (docs/design.md §8): the identity of a full KV page is a hash chain over (prefix
scope, checkpoint identity, page size, KV dtype, every token id up to the page's end). Prefill writes a page's chain
key into its tag; decode computes the chain itself from the prompt's token ids and reads a cached page only when
the keys match, so a page computed from other tokens, at another position, under another tenant or by another
checkpoint (one that differs in any byte of config.json or of its weight files) is a miss. Plain Python; BLAKE2b-128
for the chain, SHA-256 for the weight files.

The scope is decided by the gateway: the tenant the caller's API key maps to and the request's cache_salt
(`--prefix-cache-scope tenant`), or the cache_salt alone (`global`, an operator's choice to share across tenants).
"""
from __future__ import annotations

import hashlib
import os
from typing import Sequence

import numpy as np

from ..engine.config import weight_files

KEY_NBYTES = 16  # a scope or a chain key
SCOPE_TAG_NBYTES = 8
MAX_CACHE_SALT = 256  # bytes of a request's cache_salt
SCOPES = ("tenant", "global")
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
    """What decides the KV a checkpoint computes for given tokens: every byte of config.json and of each weight file
    the loader reads (engine/config.weight_files), each file by its name, size and SHA-256. Nothing is sampled: a
    partial fine-tune with the same sizes and headers is another identity. Prefill and decode (every ModelRunner)
    compute it the same way from the files, whatever dtype they serve in.

    Hashed afresh at every load, never cached: a cache keyed by each file's size and mtime would give the old
    identity to files replaced by others of the same size and mtime (cp -p, rsync -a, tar and image layers keep
    mtimes), and would be state to keep beside a checkpoint that is often read-only. SHA-256 hashes ~1.7 GiB/s
    in memory on one core with the CPU's SHA instructions (BLAKE2b ~0.9) and drops the GIL, so ModelRunner
    hashes in a thread while the same bytes load: start-up grows only by what the hash takes beyond the load
    (about 10 s of a core for a 16 GB checkpoint)."""
    parts = []
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        parts.append(f.read())
    for path in weight_files(model_dir):
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            digest = hashlib.file_digest(f, "sha256").digest()
        parts += [os.path.relpath(path, model_dir).encode(), size.to_bytes(8, "little"), digest]
    return _h(b"pdserve-checkpoint-v2", *parts)
