"""The gateway's admission (DESIGN §4): every field of a GenerateRequest is checked before any lease, allocation
or transfer, and a rejection names the field and its numbers."""
from __future__ import annotations

import secrets

from ..common.admission import (check_field_sizes, check_lengths, check_options, check_repetition_penalty,
                                check_sampling, check_stop_strings, check_tokens)
from ..common.proto import common_pb2
from ..common.wire import sampling_from_pb
from ..engine.tokenizer import min_tokens
from .scope import check_cache_salt


def sampling_of(request) -> common_pb2.SamplingParams:
    """What prefill and decode are sent, once the fields only the request can tell apart are checked (after
    check_sizes: every field copied here is within its limit)."""
    top_p = request.top_p if request.HasField("top_p") else 1.0
    check_sampling(request.max_tokens, request.temperature, top_p)
    if request.HasField("repetition_penalty"):  # 0 means "off" once inside SamplingParams, so checked here
        check_repetition_penalty(request.repetition_penalty)
    sampling = common_pb2.SamplingParams(
        temperature=request.temperature, top_p=top_p, max_tokens=request.max_tokens,
        seed=request.seed if request.HasField("seed") else secrets.randbits(63), ignore_eos=request.ignore_eos,
        top_k=request.top_k, frequency_penalty=request.frequency_penalty, presence_penalty=request.presence_penalty,
        repetition_penalty=request.repetition_penalty, stop_token_ids=request.stop_token_ids)
    if request.HasField("logprobs"):
        sampling.logprobs = request.logprobs
    sampling.logit_bias.update(request.logit_bias)
    sampling.min_p = request.min_p
    sampling.min_tokens = request.min_tokens
    sampling.json_schema = request.json_schema
    sampling.json_object = request.json_object
    return sampling


def fits(cap, num_prompt: int, max_tokens: int, at_least: str = "") -> None:
    check_lengths(num_prompt, max_tokens, cap.context_length, cap.page_size, cap.decode_pool_pages,
                  cap.prefill_pool_tokens, at_least)


def check_length_bound(tokenizer, text: str, max_tokens: int, cap) -> None:
    """Refuses text when its length alone proves its tokens cannot fit (min_tokens: O(1), no tokenizing)."""
    lower = min_tokens(tokenizer, text)
    if lower:
        fits(cap, lower, max_tokens, f"{len(text)} characters, no token spans more than "
                                     f"{tokenizer.max_chars_per_token}")


def encode_prompt(tokenizer, text: str, max_tokens: int, cap) -> list[int]:
    """text's tokens, once its length does not already prove they cannot fit."""
    check_length_bound(tokenizer, text, max_tokens, cap)
    tokens = tokenizer.encode(text)
    if tokens:
        fits(cap, len(tokens), max_tokens)
    return tokens


def check_sizes(request, cap, tokenizer) -> None:
    """Every limit the request's field lengths alone decide, on the message as received: len() of a protobuf
    repeated or map field is O(1), so a flood of oversized requests (a million logit_bias entries, stop token ids
    or prompt ids) costs no copy, sort, conversion or tokenizing, and no await: it never holds a slot."""
    check_field_sizes(len(request.logit_bias), len(request.stop_token_ids), len(request.json_schema))
    check_stop_strings(request.stop)
    check_cache_salt(request.cache_salt)
    if len(request.prompt_token_ids):
        fits(cap, len(request.prompt_token_ids), request.max_tokens)
    else:
        check_length_bound(tokenizer, request.prompt, request.max_tokens, cap)


def admit(request, cap, tokenizer) -> tuple[list[int], common_pb2.SamplingParams]:
    """The prompt's tokens and the sampling to send; cap: the gateway's Capacity."""
    check_sizes(request, cap, tokenizer)
    sampling = sampling_of(request)
    check_options(sampling_from_pb(sampling), cap.vocab_size,
                  request.prompt_logprobs if request.HasField("prompt_logprobs") else None)
    ids = request.prompt_token_ids
    tokens = list(ids) if len(ids) else encode_prompt(tokenizer, request.prompt, request.max_tokens, cap)
    check_tokens(tokens, cap.vocab_size)
    return tokens, sampling
