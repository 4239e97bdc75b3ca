"""Tokenizer: the checkpoint's `tokenizer.json` through the `tokenizers` package, or bytes when asked for."""
from __future__ import annotations

import json
import math
import os

from .config import CheckpointError
from .token_bound import max_chars_per_token


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0..255); ids above 255 are special and decode to nothing."""

    # every character is at least one byte, so a text has at least as many tokens as characters
    max_chars_per_token = 1
    no_bound_reason = ""
    longest_token = 1

    def __init__(self, vocab_size: int):
        if vocab_size < 256:
            raise ValueError(f"a byte tokenizer needs vocab_size >= 256, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def min_tokens(tokenizer, text: str) -> int:
    """A lower bound on len(tokenizer.encode(text)) from the text's length alone (O(1)): token_bound.py proves
    it; 0 when the tokenizer has no bound."""
    c = tokenizer.max_chars_per_token
    return 0 if c is None else math.ceil(len(text) / c)


class HFTokenizer:
    def __init__(self, path: str):
        from tokenizers import Tokenizer, pre_tokenizers

        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size()
        self.longest_token = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=0)  # characters
        # read back from the loaded tokenizer, not the file: the bound is about what encode() runs
        self.max_chars_per_token, self.no_bound_reason = max_chars_per_token(json.loads(self._tok.to_str()),
                                                                             pre_tokenizers.ByteLevel.alphabet())

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model_dir: str, vocab_size: int, byte_tokenizer: bool = False):
    """A missing tokenizer.json is an error: bytes fed to a model trained on another vocabulary give
    fluent-looking garbage, so the byte tokenizer is only ever chosen explicitly."""
    if byte_tokenizer:
        return ByteTokenizer(vocab_size)
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        raise CheckpointError(f"no tokenizer at {path}; add the model's tokenizer.json there, or pass "
                              f"--byte-tokenizer to encode text as UTF-8 bytes (ids 0..255)")
    return HFTokenizer(path)


class IncrementalDecoder:
    """Streams text token by token without splitting multi-byte characters.

    Each push decodes a short window, not the whole sequence so far (which made a long stream
    quadratic): the text of ids[prefix:] minus the text of ids[prefix:read]. The window starts one
    step back so its first token is decoded next to its left neighbour, as tokenizers that mark word
    starts need (the offsets vLLM's detokenizer keeps)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # where the decoded window starts
        self._read = 0    # ids before this are already text

    def _pending(self) -> tuple[str, str]:
        return (self._tok.decode(self._ids[self._prefix:self._read]), self._tok.decode(self._ids[self._prefix:]))

    def push(self, ids: list[int]) -> str:
        self._ids.extend(ids)
        before, text = self._pending()
        if text.endswith("\ufffd") or len(text) <= len(before):
            return ""  # an incomplete character (wait for its next byte), or no text yet
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before):]

    def flush(self) -> str:
        """What push held back when the stream ends: an unfinished character comes out as U+FFFD."""
        before, text = self._pending()
        self._prefix = self._read = len(self._ids)
        return text[len(before):]
