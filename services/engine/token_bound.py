"""How many characters of a text one token can stand for, read from a tokenizer.json: with it, a prompt of n
characters has at least ceil(n / C) tokens, so an over-long text is refused from its length alone, without
tokenizing it (a flood of 10 MB prompts must not cost 10 MB of tokenizing each).

Why the bound holds (n counts code points, as Python's len() and the Rust tokenizer's chars do). The encoding
of a text T is: the added tokens found in T, then, for each stretch between them, normalize, pre-tokenize, and
split each piece with the model. C is the longest string among the vocabulary and the added tokens. When the
tokenizer.json passes every check below, each token *touches* at most C characters of what it was made from, and
every character is touched by some token, so #tokens * C >= n:
- an added token stands for exactly its content; one with lstrip/rstrip would also swallow any run of
  whitespace beside it, so those are refused;
- the normalizer never shortens a text: NFD/NFKD and Lowercase map each character to one or more, Prepend adds,
  Replace of a literal by one at least as long keeps or adds (NFC/NFKC compose, Strip/StripAccents/BertNormalizer
  delete: refused);
- the pre-tokenizer only splits or maps, dropping nothing: ByteLevel turns each UTF-8 byte into one symbol,
  Metaspace each space into one '▁' (and may prepend one), Digits/Punctuation/Split (except behaviour Removed)
  split (Whitespace/WhitespaceSplit/BertPreTokenizer drop the spaces: refused);
- the model is BPE, whose token is a merge of consecutive symbols of one piece, and its vocabulary string is those
  symbols' strings joined (a subword prefix or suffix only lengthens it): each symbol is one byte of one
  character (ByteLevel) or one character, so a token of k symbols touches at most k <= C characters. Every
  symbol ends up in a token when the vocabulary holds all 256 ByteLevel symbols, or an unknown character
  becomes one unk token (unk_token set, fuse_unk off: fused, a run of any length would be one token) or its
  bytes (byte_fallback with all 256 <0xXX> tokens); otherwise BPE silently drops unknown characters: refused;
- no truncation (it would cut the count); the post-processor only adds tokens.
A tokenizer that fails a check gets no bound (None, with the reason): its prompts are tokenized in full.
"""
from __future__ import annotations

NO_SHRINK_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend"}
KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation"}


def max_chars_per_token(spec: dict, byte_level_alphabet: list[str]) -> tuple[int | None, str]:
    """(C, "") for a tokenizer.json (parsed) that passes the checks above, else (None, why not)."""
    if spec.get("truncation"):
        return None, "the tokenizer truncates"
    added = spec.get("added_tokens") or []
    if stripping := [a["content"] for a in added if a.get("lstrip") or a.get("rstrip")]:
        return None, f"added token {stripping[0]!r} strips whitespace beside it"
    why = _normalizer(spec.get("normalizer")) or _pre_tokenizer(spec.get("pre_tokenizer"))
    if why:
        return None, why
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None, f"model {model.get('type')!r} is not BPE"
    vocab = model.get("vocab") or {}
    if not _covers_every_character(model, vocab, spec.get("pre_tokenizer"), byte_level_alphabet):
        return None, "BPE may drop characters it does not know (no full byte alphabet, unk token or byte fallback)"
    longest = max([len(s) for s in vocab] + [len(a["content"]) for a in added], default=0)
    if longest <= 0:
        return None, "the vocabulary is empty"
    return longest, ""


def _parts(spec: dict | None, key: str) -> list[dict]:
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        return [p for s in spec[key] for p in _parts(s, key)]
    return [spec]


def _normalizer(spec: dict | None) -> str:
    for n in _parts(spec, "normalizers"):
        kind = n.get("type")
        if kind == "Replace" and "String" in n.get("pattern", {}) and \
                len(n.get("content", "")) >= len(n["pattern"]["String"]) > 0:
            continue
        if kind not in NO_SHRINK_NORMALIZERS:
            return f"normalizer {kind} may shorten the text"
    return ""


def _pre_tokenizer(spec: dict | None) -> str:
    for p in _parts(spec, "pretokenizers"):
        kind = p.get("type")
        if kind == "Split" and p.get("behavior") != "Removed":
            continue
        if kind not in KEEPING_PRE_TOKENIZERS:
            return f"pre-tokenizer {kind} may drop characters"
    return ""


def _covers_every_character(model: dict, vocab: dict, pre: dict | None, alphabet: list[str]) -> bool:
    if any(p.get("type") == "ByteLevel" for p in _parts(pre, "pretokenizers")) and all(c in vocab for c in alphabet):
        return True
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return True
    return model.get("unk_token") in vocab and not model.get("fuse_unk")
