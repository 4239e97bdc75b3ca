"""The gateway's length limits are checked on the GenerateRequest as received, before any field is copied into
the SamplingParams, sorted or tokenized: each oversized field is refused INVALID_ARGUMENT with its numbers while
sampling_of and the tokenizer are booby-trapped, and a request at every limit is admitted."""
import grpc
import pytest

import pdserve.gateway.admit as admit_module
from pdserve.common.admission import MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from pdserve.common.errors import PdError
from pdserve.common.prefix import MAX_CACHE_SALT
from pdserve.common.proto import gateway_pb2
from pdserve.engine.grammar import MAX_SCHEMA_BYTES
from pdserve.gateway.admit import admit
from pdserve.gateway.servicer import Capacity
from tests.unit.gateway.test_prompt_bound import CAP, NoEncode, tiny  # noqa: F401 (tiny: a fixture)


@pytest.fixture
def no_copy(monkeypatch):
    """admit() with the copy into SamplingParams refused: a limit that is not checked before it fails the test."""
    def copied(request):
        raise AssertionError("the request was copied into a SamplingParams before its sizes were checked")
    monkeypatch.setattr(admit_module, "sampling_of", copied)


def _refused(request, tokenizer) -> PdError:
    with pytest.raises(PdError) as e:
        admit(request, CAP, tokenizer)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return e.value


def _ids(n: int) -> list[int]:
    return [2 + i % 500 for i in range(n)]


def test_a_200000_entry_logit_bias_is_refused_before_it_is_copied(no_copy, tiny):
    r = gateway_pb2.GenerateRequest(prompt_token_ids=_ids(8), max_tokens=4)
    r.logit_bias.update({i: 1.0 for i in range(200_000)})
    err = _refused(r, NoEncode(tiny))
    assert (err.reason, err.message) == ("BAD_LOGIT_BIAS", f"200000 logit_bias entries; at most {MAX_LOGIT_BIAS}")


@pytest.mark.parametrize("field, reason, message", [
    ("stop_token_ids", "BAD_STOP", f"{MAX_STOP_TOKEN_IDS + 1} stop token ids; at most {MAX_STOP_TOKEN_IDS}"),
    ("stop", "BAD_STOP", f"{MAX_STOP_STRINGS + 1} stop strings; at most {MAX_STOP_STRINGS}"),
    ("json_schema", "BAD_GRAMMAR", f"the JSON schema is {MAX_SCHEMA_BYTES + 1} bytes; at most {MAX_SCHEMA_BYTES}"),
    ("cache_salt", "BAD_CACHE_SALT", f"cache_salt is {MAX_CACHE_SALT + 1} bytes; at most {MAX_CACHE_SALT}"),
    ("prompt_token_ids", "CONTEXT_EXCEEDED", "prompt is 4093 tokens + max_tokens 4 = 4097; the model's context "
                                             "length is 4096"),
    ("prompt", "CONTEXT_EXCEEDED", "prompt is at least 4093 tokens (36837 characters, no token spans more than 9) "
                                   "+ max_tokens 4 = 4097; the model's context length is 4096"),
])
def test_one_past_each_limit_is_refused_with_its_numbers_before_anything_is_copied(no_copy, tiny, field, reason,
                                                                                    message):
    value = {"stop_token_ids": _ids(MAX_STOP_TOKEN_IDS + 1), "stop": ["x"] * (MAX_STOP_STRINGS + 1),
             "json_schema": "x" * (MAX_SCHEMA_BYTES + 1), "cache_salt": "s" * (MAX_CACHE_SALT + 1),
             "prompt_token_ids": _ids(4093), "prompt": "x" * (9 * 4093)}[field]
    r = gateway_pb2.GenerateRequest(max_tokens=4, **{field: value})
    if field != "prompt":
        r.prompt = "hello"
    err = _refused(r, NoEncode(tiny))
    assert (err.reason, err.message) == (reason, message)


def test_a_request_at_every_limit_is_admitted_and_copied_whole(tiny):
    cap = Capacity("m", 4096, vocab_size=MAX_LOGIT_BIAS, page_size=16, decode_pool_pages=2048,
                   prefill_pool_tokens=8192)  # a vocabulary with room for a full logit_bias
    stops = ["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS
    r = gateway_pb2.GenerateRequest(prompt_token_ids=_ids(4092), max_tokens=4, stop=stops,
                                    stop_token_ids=_ids(MAX_STOP_TOKEN_IDS), cache_salt="s" * MAX_CACHE_SALT,
                                    json_schema="x" * MAX_SCHEMA_BYTES)
    bias = {t: (t % 201) - 100.0 for t in range(MAX_LOGIT_BIAS)}
    r.logit_bias.update(bias)
    tokens, sampling = admit(r, cap, tiny)
    assert tokens == _ids(4092) and sampling.json_schema == r.json_schema
    assert dict(sampling.logit_bias) == bias and list(sampling.stop_token_ids) == _ids(MAX_STOP_TOKEN_IDS)
