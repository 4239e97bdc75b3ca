"""The public gRPC port's receive limit: the bytes of the largest GenerateRequest admission can accept.

gRPC refuses a bigger message itself (RESOURCE_EXHAUSTED, "Received message larger than max (N vs. M)") before
it is parsed, so an oversized request costs the gateway's event loop nothing; what passes is small enough that the
handler's length checks (admit.check_sizes) run before anything is copied. Each field is counted at its widest
legal protobuf encoding, tag and length prefix included:
- the prompt, as token ids (a non-negative int32 is a varint of at most 5 bytes) or as text (at most C characters
  per token, engine/token_bound.py, of at most 4 UTF-8 bytes each), whichever is larger, for a whole context;
- stop strings, stop token ids, logit_bias entries, cache_salt and the JSON schema at their admission limits;
- every other field as the widest varint.
A length-bounded field this file does not know fails the derivation: a new one needs its line here.
MARGIN: an eighth more plus 64 KiB, for legal encodings the count leaves out (a scalar field sent twice).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from google.protobuf.descriptor import FieldDescriptor

from ..common.admission import MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from ..common.prefix import MAX_CACHE_SALT
from ..common.proto import gateway_pb2
from ..engine.config import ModelConfig
from ..engine.grammar import MAX_SCHEMA_BYTES
from ..engine.tokenizer import ByteTokenizer

log = logging.getLogger(__name__)

TAG = 2      # a field number below 2048
LENGTH = 5   # a length prefix below 2**35
VARINT = 10  # the widest varint: a uint64, a negative int32 (a float is 4 bytes, a bool 1)
ID = 5       # a non-negative int32: a token id (a negative one is refused)
UTF8 = 4     # bytes of one character
FLOAT = 4
MARGIN_BYTES = 64 << 10

_LENGTH_TYPES = {FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE}


def _delimited(payload: int) -> int:
    return TAG + LENGTH + payload


def field_bytes(context_length: int, chars_per_token: int) -> dict[str, int]:
    """The widest legal encoding of each GenerateRequest field; prompt_token_ids is counted under "prompt" (a
    request needs one of the two: the text is ignored when ids are given)."""
    bound = {
        "prompt": max(_delimited(ID * context_length), _delimited(UTF8 * chars_per_token * context_length)),
        "prompt_token_ids": 0,
        "stop": MAX_STOP_STRINGS * _delimited(UTF8 * MAX_STOP_CHARS),
        "stop_token_ids": _delimited(ID * MAX_STOP_TOKEN_IDS),
        "cache_salt": _delimited(MAX_CACHE_SALT),
        # each entry is a message of its own: key (tag + id) and value (tag + float)
        "logit_bias": MAX_LOGIT_BIAS * _delimited(1 + ID + 1 + FLOAT),
        "json_schema": _delimited(UTF8 * MAX_SCHEMA_BYTES),
    }
    out = {}
    for f in gateway_pb2.GenerateRequest.DESCRIPTOR.fields:
        if f.name in bound:
            out[f.name] = bound[f.name]
        elif f.is_repeated or f.type in _LENGTH_TYPES:
            raise ValueError(f"GenerateRequest.{f.name} has no size bound in request_size.py")
        else:
            out[f.name] = TAG + VARINT
    return out


def max_request_bytes(context_length: int, chars_per_token: int) -> int:
    total = sum(field_bytes(context_length, chars_per_token).values())
    return total + total // 8 + MARGIN_BYTES


@dataclass(slots=True)
class RequestLimit:
    """The port's limit, and the characters per token of the tokenizer it is checked against."""
    max_bytes: int
    chars_per_token: int
    _warned: int = 0  # the last context length found too long for max_bytes

    def check_context(self, context_length: int) -> None:
        """The backends' context length, once known: one longer than the limit was derived for (a backend's
        --context-length past the checkpoint's) means some legal requests are refused by the receive limit."""
        need = max_request_bytes(context_length, self.chars_per_token)
        if need > self.max_bytes and context_length != self._warned:
            self._warned = context_length
            log.warning("gateway: the backends serve a context of %d tokens, whose largest request is %d bytes; "
                        "the public gRPC port receives at most %d: larger requests are refused RESOURCE_EXHAUSTED "
                        "(raise --max-request-bytes)", context_length, need, self.max_bytes)


def _chars_per_token(tokenizer) -> int:
    if tokenizer is None:  # --byte-tokenizer: made once the vocabulary size is known
        return ByteTokenizer.max_chars_per_token
    if tokenizer.max_chars_per_token is not None:
        return tokenizer.max_chars_per_token
    log.warning("gateway: the tokenizer has no proven bound on characters per token (%s): the receive limit counts "
                "a text prompt's tokens at its longest token, %d characters", tokenizer.no_bound_reason,
                tokenizer.longest_token)
    return tokenizer.longest_token


def request_limit(given: int, model_path: str, tokenizer, context_length: int = 0) -> RequestLimit:
    """--max-request-bytes when given (> 0), else derived from the context the stack serves (--context-length, or
    the checkpoint's config.json) and the tokenizer's characters per token (None: the byte tokenizer)."""
    if given < 0:
        raise SystemExit(f"gateway: --max-request-bytes must be > 0 (0: derived), got {given}")
    if context_length < 0:
        raise SystemExit(f"gateway: --context-length must be > 0 (0: the checkpoint's), got {context_length}")
    chars = _chars_per_token(tokenizer)
    if given:
        log.info("gateway: the public gRPC port receives requests of up to %d bytes (--max-request-bytes)", given)
        return RequestLimit(given, chars)
    try:
        context = context_length or ModelConfig.from_dir(model_path).max_position_embeddings
    except (OSError, ValueError) as e:
        raise SystemExit(f"gateway: cannot derive the public gRPC port's receive limit from the checkpoint's "
                         f"context length ({e}); pass --context-length or --max-request-bytes") from None
    limit = RequestLimit(max_request_bytes(context, chars), chars)
    log.info("gateway: the public gRPC port receives requests of up to %d bytes (derived: a %d-token context at "
             "%d characters per token, every other field at its limit; --max-request-bytes)", limit.max_bytes,
             context, chars)
    return limit
