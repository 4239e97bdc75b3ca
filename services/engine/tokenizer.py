"""Tokenizer: `tokenizer.json` through the `tokenizers` package when present, bytes otherwise."""
from __future__ import annotations

import os


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0..255); ids above 255 are special and decode to nothing."""

    def __init__(self, vocab_size: int):
        if vocab_size < 256:
            raise ValueError(f"a byte tokenizer needs vocab_size >= 256, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model_dir: str, vocab_size: int):
    path = os.path.join(model_dir, "tokenizer.json")
    return HFTokenizer(path) if os.path.exists(path) else ByteTokenizer(vocab_size)


class IncrementalDecoder:
    """Streams text token by token without splitting multi-byte characters."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._emitted = 0

    def push(self, ids: list[int]) -> str:
        self._ids.extend(ids)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""  # an incomplete character: wait for its next byte
        new = text[self._emitted:]
        self._emitted = len(text)
        return new
