"""Start-up capacity check (DESIGN §4): a pool smaller than the context window is refused unless overridden."""
from __future__ import annotations

import logging

from .metrics import POOL_CONTEXT_RATIO, POOL_SHORTFALL

log = logging.getLogger(__name__)


class CapacityError(SystemExit):
    pass


def check_pool_capacity(service: str, pool: str, pool_tokens: int, context_length: int, allow_smaller: bool) -> int:
    """Returns the longest request the pool admits; exits non-zero when the pool is short and not allowed."""
    POOL_CONTEXT_RATIO.labels(pool).set(pool_tokens / context_length)
    shortfall = max(0, context_length - pool_tokens)
    POOL_SHORTFALL.labels(pool).set(shortfall)
    if shortfall:
        msg = (f"{service}: KV pool {pool} holds {pool_tokens} tokens but the context length is "
               f"{context_length} ({shortfall} short)")
        if not allow_smaller:
            raise CapacityError(f"{msg}; refusing to start. Grow the pool, lower --context-length, or pass "
                                f"--allow-pool-smaller-than-context to serve with admission capped at the pool.")
        log.warning("%s; serving with admission capped at %d tokens (--allow-pool-smaller-than-context)",
                    msg, pool_tokens)
    return min(pool_tokens, context_length)
