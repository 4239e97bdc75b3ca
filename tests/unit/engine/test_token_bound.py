"""The lower bound on a text's tokens from its length (engine/token_bound.py) against full tokenization: it never
exceeds the real count on the tokenizers it accepts, and each tokenizer.json feature it refuses really breaks it."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from pdserve.engine.token_bound import max_chars_per_token
from pdserve.engine.tokenizer import ByteTokenizer, HFTokenizer, min_tokens

EDGE = ["", "a", " ", "\n" * 500, " answered" * 300, "<s></s>" * 200, "<s>" * 3 + "</s>", "世界" * 700,
        "🙂" * 400, "Grüße, naïve € 12 — 世界! 🙂" * 50, "e\u0301" * 300, "\x00\x01\x7f" * 100,
        "The quick brown fox jumps over the lazy dog. " * 40, " " * 2000, "0123456789" * 100]


@pytest.fixture(scope="module")
def tiny(model_dir):
    return HFTokenizer(f"{model_dir}/tokenizer.json")


def _bound(tok) -> int | None:
    return max_chars_per_token(json.loads(tok.to_str()), pre_tokenizers.ByteLevel.alphabet())[0]


def test_the_tiny_tokenizer_has_a_bound_and_it_is_tight(tiny):
    assert tiny.max_chars_per_token == max(len(s) for s in tiny._tok.get_vocab())  # 9: "Ġanswered"
    text = " answered" * 300  # one token per 9 characters: the bound is reached exactly
    assert min_tokens(tiny, text) == len(tiny.encode(text)) == 300


@pytest.mark.parametrize("text", EDGE, ids=range(len(EDGE)))
def test_bound_never_exceeds_the_count_on_edge_cases(tiny, text):
    assert min_tokens(tiny, text) <= len(tiny.encode(text))
    byte = ByteTokenizer(512)
    assert min_tokens(byte, text) <= len(byte.encode(text))
    assert (min_tokens(byte, text) == len(byte.encode(text))) == text.isascii()


@settings(max_examples=100, deadline=None)
@given(text=st.text(st.characters(codec="utf-8"), max_size=300) | st.lists(
    st.sampled_from(["<s>", "</s>", " answered", "世", "🙂", " ", "e\u0301", "x"]), max_size=200).map("".join))
def test_bound_never_exceeds_the_count_on_any_text(tiny, text):
    assert min_tokens(tiny, text) <= len(tiny.encode(text))


def _sentencepiece_like() -> Tokenizer:
    """Metaspace, byte fallback and a Lowercase/Replace normalizer: the other shape the bound accepts."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": b + 1 for b in range(256)}, "▁": 257, "▁the": 258, "he": 259, "t": 260,
             "h": 261, "e": 262, "▁a": 263, "a": 264, "the": 265}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("h", "e"), ("t", "he"), ("▁", "the"), ("▁", "a")],
                               unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Lowercase(), normalizers.Replace("x", "yy")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return tok


@settings(max_examples=100, deadline=None)
@given(text=st.text(st.sampled_from("the a THE xX é世🙂 \n"), max_size=200))
def test_bound_holds_for_a_sentencepiece_like_tokenizer(text):
    tok = _sentencepiece_like()
    c = _bound(tok)
    assert c == len("<0x00>")
    assert -(-len(text) // c) <= len(tok.encode(text, add_special_tokens=False).ids)


def _bpe(**kw) -> Tokenizer:
    return Tokenizer(models.BPE(vocab={"a": 0, "[UNK]": 1}, merges=[], **kw))


def _whitespace():
    tok = _bpe(unk_token="[UNK]")
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def _strip_accents():
    tok = _bpe(unk_token="[UNK]")
    tok.normalizer = normalizers.StripAccents()
    return tok


def _lstrip_added():
    tok = _bpe(unk_token="[UNK]")
    tok.add_tokens([AddedToken("<m>", lstrip=True)])
    return tok


REFUSED = [  # (tokenizer, a text on which ceil(len / longest token) would exceed the real count, reason)
    (_whitespace, "a" + " " * 100, "pre-tokenizer Whitespace"),
    (_strip_accents, "a" + "\u0301" * 100, "normalizer StripAccents"),
    (lambda: _bpe(unk_token="[UNK]", fuse_unk=True), "a" + "z" * 100, "does not know"),
    (lambda: _bpe(), "a" + "z" * 100, "does not know"),
    (_lstrip_added, "a" + " " * 100 + "<m>", "strips whitespace"),
]


@pytest.mark.parametrize("make, text, why", REFUSED, ids=[w for _, _, w in REFUSED])
def test_each_refused_feature_really_breaks_the_bound(make, text, why):
    tok = make()
    spec = json.loads(tok.to_str())
    longest = max([len(s) for s in spec["model"]["vocab"]] + [len(a["content"]) for a in spec["added_tokens"]])
    assert -(-len(text) // longest) > len(tok.encode(text, add_special_tokens=False).ids)  # the naive bound lies
    c, reason = max_chars_per_token(spec, pre_tokenizers.ByteLevel.alphabet())
    assert c is None and why in reason


def test_truncation_and_other_models_get_no_bound(tiny):
    spec = json.loads(tiny._tok.to_str())
    assert max_chars_per_token({**spec, "truncation": {"max_length": 8}}, [])[1] == "the tokenizer truncates"
    assert "WordPiece" in max_chars_per_token({**spec, "model": {"type": "WordPiece"}}, [])[1]
    assert "NFC" in max_chars_per_token({**spec, "normalizer": {"type": "NFC"}}, [])[1]
