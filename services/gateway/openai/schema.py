"""Request bodies as pydantic models following the OpenAI schema. Strict: no string-to-number coercion,
no NaN or infinity, and a field the server does not implement is refused by name (extra="forbid").
Beyond OpenAI, as vLLM accepts them: top_k, repetition_penalty, stop_token_ids, ignore_eos."""
from __future__ import annotations

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

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


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
        return out


class ChatRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, lt=2**32)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict] | None = None  # rendered into the prompt by the template; tool calls are not parsed
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
