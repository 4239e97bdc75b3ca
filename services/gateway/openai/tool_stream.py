"""Streamed tool calls in OpenAI's delta format: per call, one delta with its index, id, type and function name
(arguments ""), then its argument fragments. Content streams as long as no call can start in it; a call goes out
once its text is complete. Every delta is a piece of what ToolPlan.parse makes of the whole output, so a stream
adds up to exactly the non-streamed message."""
from __future__ import annotations

from .tools import Call, ToolPlan, new_call_id


class ToolStream:
    """One choice's output as it grows: push(text) and finish() give the deltas to send."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.content_sent = ""
        self.calls: list[Call] = []  # sent so far, in order
        self.ids: list[str] = []
        self.args_sent = ""  # named: the arguments streamed so far

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def push(self, piece: str) -> list[dict]:
        self.text += piece
        if self.plan.mode == "named":
            return self._named(piece)
        content, calls = self.plan.settled(self.text)
        return self._content(content) + self._calls(calls)

    def finish(self) -> list[dict]:
        if self.plan.mode == "named":
            return self._named("") if not self.calls else []
        content, calls = self.plan.parse(self.text)
        return self._content(content or "") + self._calls(calls)

    def _content(self, content: str) -> list[dict]:
        if not content.startswith(self.content_sent):  # settled() only ever grows a prefix of the final content
            raise AssertionError(f"tool stream: content {content!r} does not extend {self.content_sent!r}")
        new, self.content_sent = content[len(self.content_sent):], content
        return [{"content": new}] if new else []

    def _calls(self, calls: list[Call]) -> list[dict]:
        if calls[:len(self.calls)] != self.calls:
            raise AssertionError(f"tool stream: calls {calls} do not extend {self.calls}")
        out = []
        for call in calls[len(self.calls):]:
            out += self._open(call.name)
            out.append(_fragment(len(self.calls) - 1, call.arguments))
            self.calls[-1] = call
        return out

    def _open(self, name: str) -> list[dict]:
        k = len(self.calls)
        self.ids.append(new_call_id())
        self.calls.append(Call(name, ""))
        return [{"tool_calls": [{"index": k, "id": self.ids[k], "type": "function",
                                 "function": {"name": name, "arguments": ""}}]}]

    def _named(self, piece: str) -> list[dict]:
        out = self._open(self.plan.name) if not self.calls else []
        if piece:
            out.append(_fragment(0, piece))
            self.calls[0] = Call(self.plan.name, self.calls[0].arguments + piece)
        return out


def _fragment(index: int, arguments: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}
