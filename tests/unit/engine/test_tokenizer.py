"""Tokenizers (byte and tokenizer.json) and the streaming decoder."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.make_model import VOCAB_SIZE, make_model
from pdserve.engine.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDecoder, load_tokenizer

TEXT = "Grüße, 世界! € 12 — naïve 🙂"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tok") / "tiny"), "tiny", 0)


def test_byte_round_trip_non_ascii():
    tok = ByteTokenizer(512)
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert len(ids) > len(TEXT)  # multi-byte characters take several ids
    assert tok.decode(ids) == TEXT


def test_byte_special_ids_decode_to_nothing():
    tok = ByteTokenizer(512)
    ids = tok.encode("ab")
    assert tok.decode([256] + ids[:1] + [300, 511] + ids[1:] + [1000]) == "ab"
    assert tok.decode([256, 257]) == ""


def test_byte_needs_256_ids():
    with pytest.raises(ValueError, match="255"):
        ByteTokenizer(255)


def test_hf_round_trip_ascii(hf_dir):
    tok = HFTokenizer(f"{hf_dir}/tokenizer.json")
    assert tok.vocab_size == VOCAB_SIZE
    text = "The quick brown fox jumps over the lazy dog, hello world."
    ids = tok.encode(text)
    assert 0 < len(ids) < len(text)  # BPE merges: fewer ids than bytes
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    assert tok.decode(ids) == text


def test_hf_skips_special_tokens(hf_dir):
    tok = HFTokenizer(f"{hf_dir}/tokenizer.json")
    ids = tok.encode("hello there")
    assert tok.decode([0] + ids + [1]) == "hello there"  # <s>=0, </s>=1 in make_model


def test_load_tokenizer_needs_the_file_unless_bytes_are_asked_for(hf_dir, tmp_path):
    assert isinstance(load_tokenizer(hf_dir, VOCAB_SIZE), HFTokenizer)
    with pytest.raises(ValueError) as e:
        load_tokenizer(str(tmp_path), 300)
    assert str(tmp_path / "tokenizer.json") in str(e.value) and "--byte-tokenizer" in str(e.value)
    chosen = load_tokenizer(str(tmp_path), 300, byte_tokenizer=True)
    assert isinstance(chosen, ByteTokenizer) and chosen.vocab_size == 300
    assert chosen.encode("hé") == [104, 195, 169]


def _stream(tok, ids, chunk=1):
    dec = IncrementalDecoder(tok)
    return [dec.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_incremental_byte_concat_equals_full(chunk):
    tok = ByteTokenizer(512)
    ids = tok.encode(TEXT)
    pieces = _stream(tok, ids, chunk)
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_hf_concat_equals_full(hf_dir):
    tok = HFTokenizer(f"{hf_dir}/tokenizer.json")
    text = "Once upon a time there was a small model. Grüße € 世界"
    ids = tok.encode(text)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_never_splits_a_character():
    tok = ByteTokenizer(512)
    dec = IncrementalDecoder(tok)
    assert dec.push([ord("a")]) == "a"
    e1, e2, e3 = "€".encode("utf-8")
    assert dec.push([e1]) == ""
    assert dec.push([e2]) == ""
    assert dec.push([e3]) == "€"
    assert dec.push([ord("b")]) == "b"
    assert dec.push([300]) == ""  # a special id adds no text


def test_incremental_four_byte_character_in_one_push_after_partial():
    tok = ByteTokenizer(512)
    dec = IncrementalDecoder(tok)
    b = "🙂x".encode("utf-8")
    assert dec.push(list(b[:2])) == ""
    assert dec.push(list(b[2:])) == "🙂x"


def test_flush_gives_what_an_unfinished_character_held_back():
    tok = ByteTokenizer(512)
    dec = IncrementalDecoder(tok)
    e1, e2, _ = "€".encode("utf-8")
    assert dec.push([ord("a"), e1, e2]) == ""  # "a" waits with the incomplete character behind it
    assert dec.flush() == tok.decode([ord("a"), e1, e2]) == "a\ufffd"
    assert dec.flush() == ""


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 300), max_size=60), chunk=st.integers(1, 4))
def test_incremental_stream_plus_flush_equals_full_decode(ids, chunk):
    tok = ByteTokenizer(512)
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    assert "".join(pieces) + dec.flush() == tok.decode(ids)


def test_incremental_hf_random_ids_stream_equals_full_decode(hf_dir):
    tok = HFTokenizer(f"{hf_dir}/tokenizer.json")
    rng = random.Random(7)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 80))]
        dec = IncrementalDecoder(tok)
        assert "".join(dec.push([i]) for i in ids) + dec.flush() == tok.decode(ids)


def test_incremental_push_decodes_a_window_not_the_whole_stream():
    calls = []

    class Counting(ByteTokenizer):
        def decode(self, ids):
            calls.append(len(ids))
            return super().decode(ids)

    dec = IncrementalDecoder(Counting(512))
    for b in ("x" * 500).encode():
        dec.push([b])
    assert max(calls) <= 2  # the old decoder re-decoded all 500 ids on the last push


def test_up_passes_byte_tokenizer_and_dtype_to_the_services(hf_dir, monkeypatch):
    from pdserve import cli, launcher
    seen = {}

    def start_stack(model, **kw):
        seen.update(kw)
        raise KeyboardInterrupt  # stop `up` here: nothing is started
    monkeypatch.setattr(launcher, "start_stack", start_stack)
    auto, bf16 = ["--dtype", "auto", "--kv-cache-dtype", "auto"], ["--dtype", "float32", "--kv-cache-dtype", "bfloat16"]
    alias = ["--dtype", "auto", "--kv-dtype", "bfloat16"]  # the deprecated spelling reaches the services, which warn
    host = ["--host", "127.0.0.1"]  # up's default --host, which the gateway's HTTP API listens on
    for argv, extra in ((["--byte-tokenizer"], {"prefill": auto, "decode": auto, "gateway": ["--byte-tokenizer", *host]}),
                        (["--dtype", "float32", "--kv-cache-dtype", "bfloat16"],
                         {"prefill": bf16, "decode": bf16, "gateway": host}),
                        (["--kv-dtype", "bfloat16"], {"prefill": alias, "decode": alias, "gateway": host})):
        with pytest.raises(KeyboardInterrupt):
            cli.main(["up", "--model", hf_dir, *argv])
        assert seen["extra"] == extra
