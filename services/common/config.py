"""Default ports and shared sizing rules (DESIGN §5: every default is overridable)."""
from __future__ import annotations

GATEWAY_PORT = 50051
GATEWAY_HTTP_PORT = 8000
BROKER_PORT = 50052
PREFILL_PORT = 50053
DECODE_PORT = 50054
METRICS_PORTS = {"gateway": 9101, "broker": 9102, "prefill": 9103, "decode": 9104}

DEFAULT_MODEL = "models/pdserve-tiny"
DEFAULT_PAGE_SIZE = 16
DEFAULT_PREFILL_POOL_TOKENS = 8192
DEFAULT_DECODE_POOL_TOKENS = 32768


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


DEFAULT_HEADROOM_PAGES = 2  # pages on demand: leased beyond the prompt up front, and kept ahead while generating


def pages_up_front(num_prompt_tokens: int, max_tokens: int, page_size: int,
                   headroom_pages: int = DEFAULT_HEADROOM_PAGES) -> int:
    """Pages a request is granted before its first token: its prompt's plus a small headroom (pages on demand:
    the rest is leased as it generates), never more than it can ever use."""
    return min(pages_needed(num_prompt_tokens, max_tokens, page_size),
               pages_for(num_prompt_tokens, page_size) + headroom_pages)


def pages_needed(num_prompt_tokens: int, max_tokens: int, page_size: int) -> int:
    """Decode pages a request leases: every prompt token plus every generated token that is fed back
    (the last generated token is never fed back, so it needs no KV slot)."""
    return pages_for(num_prompt_tokens + max_tokens - 1, page_size)
