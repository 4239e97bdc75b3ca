"""Token ids written as text (OpenAI's logit_bias keys, `pdserve generate --prompt-token-ids`): ASCII decimal digits,
no sign, space or leading zero, below a bound. str.isdigit() and int() take far more: superscripts ('²', which int()
then refuses), other scripts' digits ('٣' reads as 3), signs, spaces and underscores; int() of more than 4,300
digits raises; and two spellings of one id ('7', '07') would let a map's later entry win without a word."""
from __future__ import annotations

MAX_TOKEN_ID = 2**31 - 1  # the wire's int32
SHOWN = 20  # characters of a refused text quoted back


def _quoted(text: str) -> str:
    return repr(text[:SHOWN]) + (f"... ({len(text)} characters)" if len(text) > SHOWN else "")


def parse_token_id(text: str, vocab_size: int | None = None) -> int:
    """text as a token id in [0, vocab_size) (None: the wire's int32); ValueError naming the text, truncated."""
    if not (text.isascii() and text.isdigit()) or (len(text) > 1 and text[0] == "0"):
        raise ValueError(f"{_quoted(text)} is not a token id (ASCII digits 0-9 only, no sign, space or leading zero)")
    limit = MAX_TOKEN_ID + 1 if vocab_size is None else vocab_size
    # the length first: int() never sees more digits than the largest id has
    if len(text) > len(str(limit - 1)) or int(text) >= limit:
        where = "int32" if vocab_size is None else "the vocabulary"
        raise ValueError(f"{_quoted(text)} is outside {where} [0, {limit})")
    return int(text)
