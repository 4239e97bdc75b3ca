"""Structured output: a JSON schema (or "any JSON object") enforced while sampling, as a mask over the logits.

The grammar travels as data (SamplingParams.grammar: the schema's JSON text, or the json_object flag) and is
compiled by llguidance where it is used, against the checkpoint's own tokenizer: the gateway compiles it to refuse
what the library cannot compile, prefill to sample the first token, decode every later one. A request's state is a
matcher that has consumed every token the request generated so far, so prefill's first token and decode's later
ones are drawn under one grammar; decode's matcher must first accept the tokens prefill chose, or the request ends.

JSON is compact (no free whitespace), and an object refuses the properties its schema does not declare unless
the schema says otherwise (closed_objects.py): a schema whose language is finite (enums, booleans, bounded
integers) closes after a bounded number of tokens, whatever the model prefers. Compiled grammars are kept by
schema in a bounded LRU; each request gets a copy of the compiled matcher."""
from __future__ import annotations

import json
import os
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from .closed_objects import close

if TYPE_CHECKING:
    import torch
# torch is imported where a mask is made, not here: the gateway compiles grammars and never makes a mask, and
# importing torch was two thirds of its start (2.2 s of 3.3 s of CPU, in every process the tests start)

MAX_SCHEMA_BYTES = 64 * 1024  # a schema's JSON text; admission refuses longer ones
CACHE_ENTRIES = 256
_COMPACT = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The library refused the grammar (its own words), or structured output is not available here."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a request is held to: json_schema (JSON text of a schema) or, with json_object, any JSON object."""
    json_schema: str = ""
    json_object: bool = False

    def schema(self) -> str:
        return '{"type": "object"}' if self.json_object else self.json_schema


def spec_of(json_schema: str, json_object: bool) -> GrammarSpec | None:
    return GrammarSpec(json_schema, json_object) if json_schema or json_object else None


class GrammarState:
    """One request's position in its grammar: every token it generated so far has been consumed."""

    __slots__ = ("matcher",)

    def __init__(self, matcher):
        self.matcher = matcher

    def accept(self, token: int) -> str | None:
        """Consumes token; None, or why the grammar refused it (the state is then dead)."""
        if self.matcher.consume_token(token):
            return None
        return self.matcher.get_error() or f"token {token} is not allowed here"

    def replay(self, tokens: Sequence[int], what: str = "generated token") -> str | None:
        """Consumes tokens generated before (by prefill, or before a preemption); None, or the first refusal."""
        for i, t in enumerate(tokens):
            if (why := self.accept(t)) is not None:
                return f"{what} {i} (id {t}) breaks the grammar: {why}"
        return None

    @property
    def is_done(self) -> bool:
        """Nothing but the end may follow: the output is complete under the grammar (or the matcher failed)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


def _load_llguidance():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise GrammarError(f"structured output needs the llguidance package: {e}") from None
    return llguidance


class Grammars:
    """Compiles grammars for one checkpoint's tokenizer and keeps the last CACHE_ENTRIES compiled by schema.
    Thread-safe: services compile off their event loop, and decode computes masks in its step thread."""

    def __init__(self, tokenizer_json: str | None, vocab_size: int, eos_token_ids: Iterable[int],
                 max_entries: int = CACHE_ENTRIES):
        """tokenizer_json: the checkpoint's tokenizer.json (None: the checkpoint has none, and structured output is
        refused); vocab_size: the model's logits width (the mask covers every logit)."""
        self.path = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.max_entries = max_entries
        self._tokenizer = None
        self._cache: OrderedDict[GrammarSpec, object] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, model_dir: str, config) -> Grammars:
        path = os.path.join(model_dir, "tokenizer.json")
        return cls(path if os.path.exists(path) else None, config.vocab_size, config.eos_token_ids)

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                if self.path is None:
                    raise GrammarError("structured output needs the checkpoint's tokenizer.json, which this "
                                       "instance does not have")
                llg = _load_llguidance()
                try:
                    self._tokenizer = llg.LLTokenizer(self.path, n_vocab=self.vocab_size,
                                                      eos_token=self.eos_token_ids or None)
                except Exception as e:  # noqa: BLE001  (the library's own words, whatever it raises)
                    raise GrammarError(f"the grammar library cannot read {self.path}: {e}") from None
            return self._tokenizer

    def compile(self, spec: GrammarSpec):
        """The compiled matcher at the grammar's start (shared: copy it); raises GrammarError with the library's
        message for a grammar it cannot compile."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        llg = _load_llguidance()
        tok = self.tokenizer()
        if len(spec.schema()) > MAX_SCHEMA_BYTES:
            raise GrammarError(f"the JSON schema is {len(spec.schema())} bytes; at most {MAX_SCHEMA_BYTES}")
        try:
            schema = json.loads(spec.schema())
        except (ValueError, RecursionError) as e:
            raise GrammarError(f"not a JSON schema: {e}") from None
        try:
            schema = json.dumps(close(schema))
        except ValueError as e:
            raise GrammarError(str(e)) from None
        except RecursionError:
            raise GrammarError(f"the JSON schema nests (or chains $refs) deeper than {sys.getrecursionlimit()} "
                               "levels") from None
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)
        except ValueError as e:
            raise GrammarError(f"not a JSON schema: {e}") from None
        # terse errors: the library's words reach the client, without a dump of the whole grammar
        matcher = llg.LLMatcher(tok, grammar, log_level=0, limits=llg.LLParserLimits(verbose_errors=False))
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        with self._lock:
            self._cache[spec] = matcher
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return matcher

    def start(self, spec: GrammarSpec) -> GrammarState:
        """A fresh state at the grammar's start; raises GrammarError when the grammar does not compile."""
        return GrammarState(self.compile(spec).deep_copy())



def fill(states: Sequence[GrammarState], vocab_size: int) -> torch.Tensor:
    """The allowed tokens of each state's next step, as an int32 bitmask [len(states), ceil(vocab_size / 32)] (bit
    t % 32 of word t // 32 set: token t allowed)."""
    import torch
    mask = torch.full((len(states), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    row = mask.shape[1] * 4
    for i, s in enumerate(states):  # the library writes each row in place (and drops the GIL meanwhile)
        s.matcher.unsafe_compute_mask_ptr(mask.data_ptr() + i * row, row)
    return mask


def allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask: [R, W] int32 -> [R, vocab_size] bool, on the bitmask's device."""
    import torch
    if bitmask.device.type == "cpu":  # numpy's unpacking is one C loop: half the time of the shifts below
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=-1, count=vocab_size,
                             bitorder="little")
        return torch.from_numpy(bits.view(np.bool_))
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[:, :, None] >> bits) & 1).view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_mask(x: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """x: [R, V] float logits of constrained rows, masked in place: a token the grammar forbids gets -inf. On a
    GPU the bitmask (V / 8 bytes a row) crosses to the device and is unpacked there."""
    return x.masked_fill_(~allowed(bitmask.to(x.device), x.shape[-1]), float("-inf"))


def describe(spec: GrammarSpec | None) -> str:
    if spec is None:
        return "none"
    if spec.json_object:
        return "json_object"
    try:
        title = json.loads(spec.json_schema).get("title")
    except (ValueError, AttributeError):
        title = None
    return f"json_schema {title!r}" if title else f"json_schema ({len(spec.json_schema)} bytes)"
