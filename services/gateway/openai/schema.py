"""Request bodies as pydantic models following the OpenAI schema. Strict: no string-to-number coercion,
no NaN or infinity, and a field the server does not implement is refused by name (extra="forbid").
Beyond OpenAI, as vLLM accepts them: top_k, repetition_penalty, stop_token_ids, ignore_eos, min_p, min_tokens."""
from __future__ import annotations

import json
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

# the gateway's admission limits (common/admission.py), so that HTTP refuses exactly what gRPC refuses
from ...common.admission import MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

MAX_N = 16
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
Stop = Union[Annotated[str, Field(min_length=1)], Annotated[list[Annotated[str, Field(min_length=1)]],
                                                            Field(max_length=MAX_STOP_STRINGS)], None]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far (guidellm asks for it)


class JsonSchemaFormat(Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict = Field(alias="schema")
    # accepted and changes nothing: every schema is held as OpenAI's strict mode holds it, objects closed to the
    # properties they declare (engine/closed_objects.py); false does not loosen that
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Sampling(Strict):
    """The fields both endpoints share."""
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, lt=2**32)] | None = None
    temperature: Annotated[float, Field(ge=0)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0, lt=2**32)] = 0
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: Stop = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] = []
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # logged with the request id, as OpenAI uses it: to trace abuse to an end user
    cache_salt: str | None = None  # vLLM's: requests of other salts never share cached KV (at most 256 bytes)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None  # token id (as text) -> bias
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    min_tokens: Annotated[int, Field(ge=0, lt=2**32)] = 0
    response_format: ResponseFormat | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def grammar(self) -> tuple[str, bool]:
        """(json_schema text, json_object) of response_format; ("", False) for text or none."""
        f = self.response_format
        if f is None or f.type == "text":
            return "", False
        if f.type == "json_object":
            return "", True
        if f.json_schema is None:
            raise ValueError("response_format json_schema needs its json_schema object")
        return json.dumps(f.json_schema.schema_, ensure_ascii=False), False


class CompletionRequest(Sampling):
    prompt: Union[Annotated[str, Field(min_length=1)], Annotated[list[TokenId], Field(min_length=1)],
                  Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=64)],
                  Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=64)]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Function(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    id: str
    type: Literal["function"]
    function: Function


class FunctionDef(Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # as JsonSchemaFormat.strict: accepted, changes nothing


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def to_template(self) -> dict:
        """What a chat template reads: content as one string (text parts joined), unset fields left out."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "".join(p.text for p in self.content)
        for call in out.get("tool_calls", []):
            # templates write arguments with tojson: an object, as the model was trained on, not a JSON string of
            # one (vLLM hands them objects too); arguments that are not JSON stay the text they are
            try:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            except ValueError:
                pass
        return out


class ChatRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, lt=2**32)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
