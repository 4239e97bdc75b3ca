"""The public port's derived receive limit against protobuf's own count: the widest legal GenerateRequest (every
field at its admission limit, each value at its widest encoding) fits, by a margin, and the count is tight;
--max-request-bytes and a checkpoint without config.json are handled with a clear line."""
import logging

import pytest

from pdserve.common.admission import MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from pdserve.common.prefix import MAX_CACHE_SALT
from pdserve.common.proto import gateway_pb2
from pdserve.engine.grammar import MAX_SCHEMA_BYTES
from pdserve.engine.tokenizer import HFTokenizer
from pdserve.gateway.request_size import field_bytes, max_request_bytes, request_limit

WIDE = "\U0001F600"  # a 4-byte UTF-8 character
TOP_ID = 2**31 - 1   # the widest non-negative int32 varint (5 bytes)


def widest(context: int, chars_per_token: int, text: bool) -> gateway_pb2.GenerateRequest:
    r = gateway_pb2.GenerateRequest(
        max_tokens=2**32 - 1, temperature=1.5, top_p=0.5, seed=2**64 - 1, ignore_eos=True, top_k=2**32 - 1,
        frequency_penalty=-2.0, presence_penalty=2.0, repetition_penalty=1.1, stop=[WIDE * MAX_STOP_CHARS] *
        MAX_STOP_STRINGS, stop_token_ids=[TOP_ID] * MAX_STOP_TOKEN_IDS, logprobs=2**32 - 1,
        prompt_logprobs=2**32 - 1, cache_salt="s" * MAX_CACHE_SALT, min_p=0.5, min_tokens=2**32 - 1,
        json_schema=WIDE * MAX_SCHEMA_BYTES, json_object=True)
    if text:
        r.prompt = WIDE * (context * chars_per_token)
    else:
        r.prompt_token_ids.extend([TOP_ID] * context)
    r.logit_bias.update({TOP_ID - i: -100.0 for i in range(MAX_LOGIT_BIAS)})
    return r


@pytest.mark.parametrize("text", [True, False], ids=["text prompt", "token ids"])
def test_the_widest_legal_request_fits_the_count_and_the_count_is_tight(text):
    context, chars = 4096, 9
    counted = sum(field_bytes(context, chars).values())
    size = widest(context, chars, text).ByteSize()
    print(f"widest request {size} bytes, counted {counted}, limit {max_request_bytes(context, chars)}")
    assert size <= counted < max_request_bytes(context, chars)
    if text:  # the text is the larger prompt here: the count is over only by length prefixes and scalar widths
        assert counted - size < 0.02 * counted


def test_every_field_of_the_request_is_counted():
    assert set(field_bytes(4096, 9)) == {f.name for f in gateway_pb2.GenerateRequest.DESCRIPTOR.fields}


def test_a_million_entry_logit_bias_is_over_the_default_limit_of_the_tiny_model():
    r = gateway_pb2.GenerateRequest(prompt_token_ids=[5] * 8, max_tokens=4)
    r.logit_bias.update({i: 1.0 for i in range(1_000_000)})
    assert r.ByteSize() > 20 * max_request_bytes(4096, 9)


def test_the_limit_is_derived_from_the_checkpoint_and_logged(model_dir, caplog):
    tok = HFTokenizer(f"{model_dir}/tokenizer.json")
    with caplog.at_level(logging.INFO, logger="pdserve.gateway.request_size"):
        limit = request_limit(0, model_dir, tok)
    assert limit.max_bytes == max_request_bytes(4096, tok.max_chars_per_token)
    assert f"receives requests of up to {limit.max_bytes} bytes (derived: a 4096-token context at 9 characters" \
        in caplog.text


def test_a_given_limit_is_used_and_a_negative_one_refused(model_dir, caplog):
    tok = HFTokenizer(f"{model_dir}/tokenizer.json")
    with caplog.at_level(logging.INFO, logger="pdserve.gateway.request_size"):
        assert request_limit(12345, model_dir, tok).max_bytes == 12345
    assert "up to 12345 bytes (--max-request-bytes)" in caplog.text
    with pytest.raises(SystemExit, match="--max-request-bytes must be > 0 \\(0: derived\\), got -1"):
        request_limit(-1, model_dir, tok)


def test_without_config_json_the_gateway_is_told_to_give_the_limit(tmp_path, model_dir):
    with pytest.raises(SystemExit, match="cannot derive .*config.json.*; pass --context-length or --max-request-bytes"):
        request_limit(0, str(tmp_path), HFTokenizer(f"{model_dir}/tokenizer.json"))


def test_the_context_the_stack_serves_sizes_the_limit(model_dir):
    """Prefill and decode given a context past the checkpoint's (their --context-length): the gateway told the same
    takes a prompt of that length through its port (the incident's 1,048,576 tokens as ids: 5 MiB)."""
    tok = HFTokenizer(f"{model_dir}/tokenizer.json")
    limit = request_limit(0, model_dir, tok, context_length=1 << 20)
    assert limit.max_bytes == max_request_bytes(1 << 20, tok.max_chars_per_token)
    assert gateway_pb2.GenerateRequest(prompt_token_ids=[500_000] * (1 << 20), max_tokens=1).ByteSize() \
        < limit.max_bytes
    assert request_limit(0, model_dir, tok).max_bytes < 1 << 20  # the checkpoint's 4,096 tokens: far less
    with pytest.raises(SystemExit, match="--context-length must be > 0"):
        request_limit(0, model_dir, tok, context_length=-1)


class Unbounded:
    max_chars_per_token = None
    no_bound_reason = "normalizer NFC may shorten the text"
    longest_token = 40


def test_a_tokenizer_without_a_bound_is_counted_at_its_longest_token_and_said(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="pdserve.gateway.request_size"):
        limit = request_limit(0, model_dir, Unbounded())
    assert limit.max_bytes == max_request_bytes(4096, 40)
    assert "no proven bound on characters per token (normalizer NFC may shorten the text)" in caplog.text


def test_a_backend_context_longer_than_derived_is_warned_once(model_dir, caplog):
    limit = request_limit(0, model_dir, None)  # the byte tokenizer: one character per token
    with caplog.at_level(logging.WARNING, logger="pdserve.gateway.request_size"):
        limit.check_context(4096)
        limit.check_context(1 << 20)
        limit.check_context(1 << 20)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "a context of 1048576 tokens" in warned[0], warned
    assert f"receives at most {limit.max_bytes}" in warned[0] and "--max-request-bytes" in warned[0]
