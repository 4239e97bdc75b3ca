"""Tool calls: what a chat request's `tools`, `tool_choice` and `parallel_tool_calls` ask for, and the calls read
back out of the model's text.

- `auto` (the default with tools): the template renders the tools and the model writes calls in its family's
  format, parsed here: Hermes/Qwen `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the format a
  template that writes `<tool_call>` teaches), else Llama 3 JSON, the whole output one or more `{"name": ...,
  "parameters": {...}}` objects (separated by `;`). Text the parser does not take stays content, unchanged.
- `none`: no tools rendered, nothing parsed.
- `required` and a named function: the call is forced through structured output (engine/grammar.py): the output is
  a JSON array of `{"name", "parameters"}` objects, or the named function's arguments object, under a JSON schema
  built from the tools' own parameter schemas.
- `parallel_tool_calls: false`: at most one call (auto keeps the first; required allows one item).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .errors import ApiError

HERMES, LLAMA3_JSON = "hermes", "llama3_json"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), re.S)
# a model's output nested deeper than the JSON parser recurses (a few thousand '[') is text, not a call
NOT_JSON = (ValueError, RecursionError)


def format_of(template) -> str:
    """The tool-call format a checkpoint's chat template teaches its model."""
    sources = getattr(template, "sources", {}) if template is not None else {}
    return HERMES if any(TOOL_OPEN in t for t in sources.values()) else LLAMA3_JSON


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str  # JSON text, as OpenAI's function.arguments

    def to_openai(self, call_id: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_of(obj) -> Call | None:
    """A parsed `{"name": ..., "arguments" | "parameters": {...}}`, or None when obj is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except NOT_JSON:
            return None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_call(text: str) -> Call | None:
    try:
        return _call_of(json.loads(text))
    except NOT_JSON:
        return None


def hermes_calls(text: str, final: bool) -> list[Call]:
    """The calls of the closed blocks (and, at the end, of an unclosed last block that is whole JSON)."""
    start = text.find(TOOL_OPEN)
    if start < 0:
        return []
    rest = text[start:]
    calls = [c for block in _BLOCK.findall(rest) if (c := _json_call(block)) is not None]
    tail = rest[rest.rfind(TOOL_CLOSE) + len(TOOL_CLOSE):] if TOOL_CLOSE in rest else rest
    if final and tail.lstrip().startswith(TOOL_OPEN) and (c := _json_call(tail.lstrip()[len(TOOL_OPEN):])):
        calls.append(c)
    return calls


def llama3_calls(text: str) -> list[Call]:
    """The whole output as `{...}` call objects separated by `;` or whitespace; [] unless all of it parses."""
    s, calls, dec = text.strip(), [], json.JSONDecoder()
    if not s.startswith("{"):
        return []
    i = 0
    while i < len(s):
        try:
            obj, i = dec.raw_decode(s, i)
        except NOT_JSON:
            return []
        if (c := _call_of(obj)) is None:
            return []
        calls.append(c)
        while i < len(s) and (s[i].isspace() or s[i] == ";"):
            i += 1
    return calls


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What one chat request does with tools. mode: none, auto, required or named (then `name`)."""
    mode: str
    fmt: str = LLAMA3_JSON
    name: str | None = None
    parallel: bool = True
    render: list[dict] | None = None  # the tools the template renders
    schema: dict | None = None  # the forced call's JSON schema (required, named)

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        """(content, calls) of a whole output: what the non-streamed answer holds and a stream adds up to."""
        if self.mode == "none":
            return text, []
        if self.mode == "named":
            return None, [Call(self.name, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except NOT_JSON:
                return text, []
            calls = [c for c in map(_call_of, items if isinstance(items, list) else []) if c is not None]
            return (None, calls) if calls else (text, [])
        calls = hermes_calls(text, True) if self.fmt == HERMES else llama3_calls(text)
        if not calls:
            return text, []
        calls = calls if self.parallel else calls[:1]
        return (text[:text.find(TOOL_OPEN)].rstrip() or None) if self.fmt == HERMES else None, calls

    def settled(self, text: str) -> tuple[str, list[Call]]:
        """What of a growing output can no longer change: a prefix of the final content, and of the final calls."""
        if self.mode == "none":
            return text, []
        if self.mode in ("named", "required"):
            return "", []  # JSON all through: named streams its arguments itself (tool_stream.py)
        if self.fmt == LLAMA3_JSON:
            return ("", []) if not text.strip() or text.lstrip().startswith("{") else (text, [])
        start = text.find(TOOL_OPEN)
        if start >= 0:
            calls = hermes_calls(text, False)
            return text[:start].rstrip(), calls if self.parallel else calls[:1]
        # hold back what may be the start of a tag, and trailing whitespace a tag would strip
        keep = len(text)
        for k in range(min(len(TOOL_OPEN) - 1, len(text)), 0, -1):
            if TOOL_OPEN.startswith(text[-k:]):
                keep -= k
                break
        return text[:keep].rstrip(), []


def _forced_schema(tools: list[dict], mode: str, name: str | None, parallel: bool) -> dict:
    def params(f: dict) -> dict:
        return f.get("parameters") or {"type": "object", "properties": {}}

    if mode == "named":
        return params(next(t["function"] for t in tools if t["function"]["name"] == name))
    one = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "parameters": params(t["function"])},
            "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": one[0] if len(one) == 1 else {"anyOf": one}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan(tools: list[dict] | None, tool_choice, parallel: bool, fmt: str, structured: bool) -> ToolPlan:
    """tools: as the request gave them (dicts); tool_choice: "none" | "auto" | "required" | {"type": "function",
    "function": {"name": ...}} | None; structured: response_format asks for JSON already."""
    if tool_choice is not None and not isinstance(tool_choice, str):
        mode, name = "named", tool_choice["function"]["name"]
    else:
        mode, name = tool_choice or ("auto" if tools else "none"), None
    if mode != "none" and not tools:
        raise ApiError(400, "invalid_value", f"tool_choice {mode!r} needs tools", param="tool_choice")
    if mode in ("required", "named") and structured:
        raise ApiError(400, "invalid_value", f"tool_choice {mode!r} forces the output's JSON, and so does "
                                             "response_format; send one", param="tool_choice")
    names = [t["function"]["name"] for t in tools or []]
    if len(set(names)) != len(names):
        raise ApiError(400, "invalid_value", f"tools name a function twice: {names}", param="tools")
    if mode == "named" and name not in names:
        raise ApiError(400, "invalid_value", f"tool_choice names function {name!r}; tools have {names}",
                       param="tool_choice")
    if mode == "auto" and structured:
        mode = "none"  # the output is the structured answer: there is no call in it to parse
    schema = _forced_schema(tools, mode, name, parallel) if mode in ("required", "named") else None
    return ToolPlan(mode, fmt, name, parallel, tools if mode != "none" else None, schema)
