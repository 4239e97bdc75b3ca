"""Start-up sizing checks (docs/design.md §4, §8) as pure functions, so `pdserve check` prints the very refusal a
service would exit with: a pool smaller than the context window is refused unless overridden, and one KV page must
fit in prefill's write unit. No torch here: the sizes come from config.json alone."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from .metrics import POOL_CONTEXT_RATIO, POOL_SHORTFALL

log = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class CapacityError(SystemExit):
    pass


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """K and V of every layer for one token, as the page-major pool lays them out (engine/kv_pool.py)."""
    return num_layers * 2 * num_kv_heads * head_dim * DTYPE_BYTES[dtype]


@dataclass(slots=True, frozen=True)
class PoolCapacity:
    max_prompt: int  # the longest request the pool admits
    refusal: str | None  # the line the service exits with, None when it starts
    warning: str | None  # logged when it starts on a short pool (--allow-pool-smaller-than-context)


def pool_capacity(service: str, pool_tokens: int, context_length: int, allow_smaller: bool) -> PoolCapacity:
    shortfall = max(0, context_length - pool_tokens)
    max_prompt = min(pool_tokens, context_length)
    if not shortfall:
        return PoolCapacity(max_prompt, None, None)
    msg = (f"{service}: KV pool holds {pool_tokens} tokens but the context length is {context_length} "
           f"({shortfall} short)")
    if not allow_smaller:
        return PoolCapacity(max_prompt, f"{msg}; refusing to start. Grow the pool, lower --context-length, or pass "
                                        f"--allow-pool-smaller-than-context to serve with admission capped at the "
                                        f"pool.", None)
    return PoolCapacity(max_prompt, None, f"{msg}; serving with admission capped at {pool_tokens} tokens "
                                          f"(--allow-pool-smaller-than-context)")


def check_pool_capacity(service: str, pool: str, pool_tokens: int, context_length: int, allow_smaller: bool) -> int:
    """Returns the longest request the pool admits; exits non-zero when the pool is short and not allowed."""
    POOL_CONTEXT_RATIO.labels(pool).set(pool_tokens / context_length)
    POOL_SHORTFALL.labels(pool).set(max(0, context_length - pool_tokens))
    cap = pool_capacity(service, pool_tokens, context_length, allow_smaller)
    if cap.refusal:
        raise CapacityError(cap.refusal)
    if cap.warning:
        log.warning("%s", cap.warning)
    return cap.max_prompt


def write_unit_refusal(page_size: int, bytes_per_token: int, max_write_bytes: int) -> str | None:
    """Prefill cuts its writes into batch calls of at most max_write_bytes, never splitting a page."""
    page_nbytes = page_size * bytes_per_token
    if page_nbytes <= max_write_bytes:
        return None
    return (f"prefill: refusing to start: one KV page ({page_size} tokens x {bytes_per_token} bytes = {page_nbytes} "
            f"bytes) does not fit in --max-write-bytes {max_write_bytes}: raise it to at least {page_nbytes} or "
            f"lower --page-size")
