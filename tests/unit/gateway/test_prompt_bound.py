"""The gateway refuses a text prompt whose length alone proves it cannot fit, without tokenizing it, and never
refuses one that fits: checked at the exact boundary where the bound is tight."""
import grpc
import pytest

from pdserve.common.errors import PdError
from pdserve.engine.tokenizer import ByteTokenizer, HFTokenizer
from pdserve.gateway.admit import encode_prompt
from pdserve.gateway.servicer import Capacity

CAP = Capacity("m", context_length=4096, vocab_size=512, page_size=16, decode_pool_pages=2048,
               prefill_pool_tokens=8192)
WORD = " answered"  # one token of the tiny tokenizer, its longest (9 characters): the bound is exact on it


@pytest.fixture(scope="module")
def tiny(model_dir):
    return HFTokenizer(f"{model_dir}/tokenizer.json")


class NoEncode:
    """The tokenizer's bound without its encode: a refusal must not tokenize."""

    def __init__(self, tok):
        self.max_chars_per_token = tok.max_chars_per_token

    def encode(self, text):
        raise AssertionError(f"tokenized {len(text)} characters")


def _refusal(tok, text: str, max_tokens: int) -> PdError:
    with pytest.raises(PdError) as e:
        encode_prompt(tok, text, max_tokens, CAP)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return e.value


def test_a_prompt_that_fits_exactly_is_admitted(tiny):
    ids = encode_prompt(tiny, WORD * 4080, 16, CAP)
    assert ids == tiny.encode(WORD * 4080) and len(ids) == 4080


def test_one_token_more_is_refused_from_the_length_alone(tiny):
    err = _refusal(NoEncode(tiny), WORD * 4081, 16)
    assert err.reason == "CONTEXT_EXCEEDED"
    assert err.message == ("prompt is at least 4081 tokens (36729 characters, no token spans more than 9) + "
                           "max_tokens 16 = 4097; the model's context length is 4096")


@pytest.mark.parametrize("make", [lambda t: NoEncode(t), lambda t: NoEncode(ByteTokenizer(512))],
                         ids=["tokenizer.json", "bytes"])
def test_a_10_mb_prompt_is_refused_with_numbers_without_tokenizing(tiny, make):
    tok = make(tiny)
    err = _refusal(tok, "x" * 10_000_000, 16)
    want = -(-10_000_000 // tok.max_chars_per_token)
    assert err.reason == "CONTEXT_EXCEEDED" and f"at least {want} tokens (10000000 characters" in err.message
    assert "context length is 4096" in err.message


def test_pool_limits_are_bounded_too(tiny):
    small = Capacity("m", 65536, 512, 16, decode_pool_pages=2048, prefill_pool_tokens=1000)
    with pytest.raises(PdError) as e:
        encode_prompt(NoEncode(tiny), WORD * 1001, 16, small)
    assert e.value.reason == "PREFILL_POOL_EXCEEDED" and "at least 1001 tokens" in e.value.message


def test_when_the_bound_cannot_tell_the_text_is_tokenized_and_counted_exactly(tiny):
    text = "世" * 2000  # 2000 characters pass the bound; 6000 UTF-8 bytes do not fit
    err = _refusal(ByteTokenizer(512), text, 16)
    assert err.message.startswith("prompt is 6000 tokens + max_tokens 16")
    n = len(tiny.encode(text))
    assert n > 4080 and _refusal(tiny, text, 16).message.startswith(f"prompt is {n} tokens")
