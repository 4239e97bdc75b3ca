"""Admission rules (DESIGN §4), shared by gateway, prefill and decode: each re-checks what it is given.

Every rejection is INVALID_ARGUMENT with a reason and the numbers; a rejected request is terminal.
"""
from __future__ import annotations

import asyncio
import math

import grpc

from ..engine.grammar import MAX_SCHEMA_BYTES, GrammarError
from .config import pages_needed
from .errors import PdError, invalid
from .metrics import ADMISSION_REJECTIONS


MAX_LOGPROBS = 20       # top log-probabilities per position, as OpenAI allows
MAX_STOP_STRINGS = 4    # as OpenAI allows
MAX_STOP_CHARS = 256    # each: the gateway holds back up to this much text while a stop string may be starting
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024   # entries of logit_bias


def _reject(reason: str, message: str) -> PdError:
    ADMISSION_REJECTIONS.labels(reason).inc()
    return invalid(reason, message)


def check_tokens(token_ids, vocab_size: int) -> None:
    if len(token_ids) == 0:
        raise _reject("EMPTY_PROMPT", "prompt is empty (0 tokens)")
    if 0 <= min(token_ids) and max(token_ids) < vocab_size:
        return
    bad = [t for t in token_ids if t < 0 or t >= vocab_size]
    if bad:
        raise _reject("TOKEN_OUT_OF_VOCAB", f"{len(bad)} prompt token ids outside [0, {vocab_size}), "
                                            f"first {bad[0]}")


def check_sampling(max_tokens: int, temperature: float, top_p: float) -> None:
    if max_tokens <= 0:
        raise _reject("BAD_MAX_TOKENS", f"max_tokens must be > 0, got {max_tokens}")
    if not math.isfinite(temperature) or temperature < 0:
        raise _reject("BAD_TEMPERATURE", f"temperature must be >= 0, got {temperature}")
    if not math.isfinite(top_p) or not (0 < top_p <= 1):
        raise _reject("BAD_TOP_P", f"top_p must be in (0, 1], got {top_p}")


def check_field_sizes(num_logit_bias: int, num_stop_token_ids: int, schema_chars: int) -> None:
    """The limits a field's length alone decides. The gateway passes len() of the fields as received (O(1) for
    protobuf repeated and map fields), so an oversized one is refused before it is copied, sorted or converted."""
    if num_logit_bias > MAX_LOGIT_BIAS:
        raise _reject("BAD_LOGIT_BIAS", f"{num_logit_bias} logit_bias entries; at most {MAX_LOGIT_BIAS}")
    if num_stop_token_ids > MAX_STOP_TOKEN_IDS:
        raise _reject("BAD_STOP", f"{num_stop_token_ids} stop token ids; at most {MAX_STOP_TOKEN_IDS}")
    if schema_chars > MAX_SCHEMA_BYTES:
        raise _reject("BAD_GRAMMAR", f"the JSON schema is {schema_chars} bytes; at most {MAX_SCHEMA_BYTES}")


def check_options(p, vocab_size: int, prompt_logprobs: int | None = None) -> None:
    """The options beyond temperature and top_p, on a SamplingParams (engine/sampler.py)."""
    check_field_sizes(len(p.logit_bias), len(p.stop_token_ids), len(p.grammar.json_schema) if p.grammar else 0)
    if p.top_k > vocab_size:
        raise _reject("BAD_TOP_K", f"top_k must be <= the vocabulary size {vocab_size} (0 for no limit), got "
                                   f"{p.top_k}")
    for name, v in (("frequency_penalty", p.frequency_penalty), ("presence_penalty", p.presence_penalty)):
        if not -2.0 <= v <= 2.0:  # NaN fails it too
            raise _reject("BAD_PENALTY", f"{name} must be in [-2, 2], got {v}")
    check_repetition_penalty(p.repetition_penalty)
    if bad := [t for t in p.stop_token_ids if not 0 <= t < vocab_size]:
        raise _reject("BAD_STOP", f"{len(bad)} stop token ids outside [0, {vocab_size}), first {bad[0]}")
    for name, n in (("logprobs", p.logprobs), ("prompt_logprobs", prompt_logprobs)):
        if n is not None and not 0 <= n <= MAX_LOGPROBS:
            raise _reject("BAD_LOGPROBS", f"{name} must be in [0, {MAX_LOGPROBS}], got {n}")
    check_structure(p, vocab_size)


def check_structure(p, vocab_size: int) -> None:
    """logit_bias, min_p, min_tokens and the grammar's fields (whether a grammar compiles is the grammar library's
    to say, where it is compiled)."""
    for t, b in p.logit_bias:
        if not 0 <= t < vocab_size:
            raise _reject("BAD_LOGIT_BIAS", f"logit_bias names token {t}, outside [0, {vocab_size})")
        if not -100.0 <= b <= 100.0:  # NaN fails it too
            raise _reject("BAD_LOGIT_BIAS", f"logit_bias of token {t} must be in [-100, 100], got {b}")
    if not 0.0 <= p.min_p <= 1.0:
        raise _reject("BAD_MIN_P", f"min_p must be in [0, 1], got {p.min_p}")
    if p.min_tokens > p.max_tokens:
        raise _reject("BAD_MIN_TOKENS", f"min_tokens {p.min_tokens} exceeds max_tokens {p.max_tokens}")
    g = p.grammar
    if g is not None:
        if g.json_object and g.json_schema:
            raise _reject("BAD_GRAMMAR", "json_object and json_schema exclude each other; send one")


def check_grammar(grammars, spec):
    """The request's grammar state at its start, compiled by grammars (engine/grammar.Grammars); a grammar the
    library refuses is INVALID_ARGUMENT BAD_GRAMMAR in the library's words. Call it off the event loop: compiling
    a large schema takes a while."""
    if spec is None:
        return None
    if grammars is None:
        raise _reject("BAD_GRAMMAR", "structured output is not available on this instance")
    try:
        return grammars.start(spec)
    except GrammarError as e:
        raise _reject("BAD_GRAMMAR", f"the grammar library refused the JSON schema: {e}") from None


def check_repetition_penalty(v: float) -> None:
    if not (math.isfinite(v) and v > 0):
        raise _reject("BAD_PENALTY", f"repetition_penalty must be finite and > 0 (1 is off), got {v}")


def check_stop_strings(stop) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise _reject("BAD_STOP", f"{len(stop)} stop strings; at most {MAX_STOP_STRINGS}")
    for i, s in enumerate(stop):
        if not 0 < len(s) <= MAX_STOP_CHARS:
            raise _reject("BAD_STOP", f"stop string {i} is {len(s)} characters; each must have 1 to "
                                      f"{MAX_STOP_CHARS}")


def check_lengths(num_prompt: int, max_tokens: int, context_length: int, page_size: int,
                  decode_pool_pages: int | None, prefill_pool_tokens: int | None, at_least: str = "") -> None:
    """at_least: num_prompt is only a lower bound on the prompt's tokens, for the reason given (every check is
    monotone in num_prompt, so a bound that does not fit proves the prompt does not)."""
    prompt = f"at least {num_prompt} tokens ({at_least})" if at_least else f"{num_prompt} tokens"
    if num_prompt + max_tokens > context_length:
        raise _reject("CONTEXT_EXCEEDED", f"prompt is {prompt} + max_tokens {max_tokens} = "
                                          f"{num_prompt + max_tokens}; the model's context length is {context_length}")
    if prefill_pool_tokens is not None and num_prompt > prefill_pool_tokens:
        raise _reject("PREFILL_POOL_EXCEEDED", f"prompt is {prompt}; the prefill KV pool holds "
                                               f"{prefill_pool_tokens}")
    if decode_pool_pages is not None:
        need = pages_needed(num_prompt, max_tokens, page_size)
        if need > decode_pool_pages:
            raise _reject("DECODE_POOL_EXCEEDED",
                          f"prompt is {prompt} + max_tokens {max_tokens} needs {need} pages of "
                          f"{page_size}; the decode KV pool holds {decode_pool_pages} pages "
                          f"({decode_pool_pages * page_size} tokens)")


async def start_grammar(grammars, spec, prefix=()):
    """check_grammar in a thread, then the tokens generated before (prefix) fed to the state: a prefix the
    grammar refuses means the services disagree on the grammar, and the request ends (INTERNAL GRAMMAR_MISMATCH)."""
    if spec is None:
        return None
    state = await asyncio.to_thread(check_grammar, grammars, spec)
    if prefix and (why := state.replay(prefix)) is not None:
        raise grammar_mismatch(why)
    return state


def grammar_mismatch(why: str) -> PdError:
    return PdError(grpc.StatusCode.INTERNAL, "GRAMMAR_MISMATCH", f"structured output: {why}")


__all__ = ["check_tokens", "check_sampling", "check_field_sizes", "check_options", "check_structure", "check_grammar",
           "start_grammar", "grammar_mismatch", "check_repetition_penalty", "check_stop_strings", "check_lengths"]
