"""Decode's token stream as GenerateResponses: text (cut at stop strings, held back only where one may start), a
stop token's text left out, log-probabilities aligned with token_ids, and the prompt's on the first message."""
from __future__ import annotations

import grpc

from ..common.errors import PdError
from ..common.proto import common_pb2, gateway_pb2
from ..engine.tokenizer import IncrementalDecoder
from .stops import StopStrings

UNFINISHED, STOP = common_pb2.FINISH_REASON_UNSPECIFIED, common_pb2.FINISH_REASON_STOP


def _missing(what: str) -> PdError:
    return PdError(grpc.StatusCode.INTERNAL, "MISSING_LOGPROBS", what)


class Responses:
    def __init__(self, tokenizer, request_id: bytes, prompt: list[int], sampling, stop: list[str], prefilled,
                 prompt_logprobs: bool):
        """sampling: the SamplingParams message sent to prefill and decode; prefilled: prefill's response."""
        self.text = IncrementalDecoder(tokenizer)
        self.stops = StopStrings(stop)
        self.request_id = request_id
        self.prompt = prompt
        self.stop_ids = set(sampling.stop_token_ids)
        self.want_logprobs = sampling.HasField("logprobs")
        if self.want_logprobs and not prefilled.HasField("first_logprobs"):
            raise _missing("prefill returned no log-probabilities for the first token")
        self.first_logprobs = prefilled.first_logprobs
        self.prompt_logprobs = list(prefilled.prompt_logprobs) if prompt_logprobs else None
        if prompt_logprobs and len(self.prompt_logprobs) != len(prompt) - 1:
            raise _missing(f"prefill returned {len(self.prompt_logprobs)} prompt log-probabilities for a "
                           f"{len(prompt)}-token prompt (expected {len(prompt) - 1})")
        self.num_sent = 0
        self._first_from_prefill = True  # the next token's log-probabilities come from prefill's answer

    def resume(self, prefilled) -> None:
        """A resubmission (after a preemption) continues this stream: its first token, and that token's
        log-probabilities, come from the new prefill's answer."""
        if self.want_logprobs and not prefilled.HasField("first_logprobs"):
            raise _missing("prefill returned no log-probabilities for the first token of a resubmission")
        self.first_logprobs = prefilled.first_logprobs
        self._first_from_prefill = True

    @property
    def stopped(self) -> bool:
        """A stop string ended the output: nothing more is read from decode."""
        return self.stops.stopped

    def make(self, r) -> gateway_pb2.GenerateResponse:
        """The response for one DecodeResponse."""
        first = self.num_sent == 0
        finish = r.finish_reason
        if finish == STOP and r.token_id in self.stop_ids:
            piece = self.text.flush()  # a stop token's text is not returned
        else:
            piece = self.text.push([r.token_id])
            if finish != UNFINISHED:
                piece += self.text.flush()  # the last token: nothing may stay held back
        text = self.stops.push(piece)
        if self.stops.stopped:
            finish = STOP
        elif finish != UNFINISHED:
            text += self.stops.flush()
        msg = gateway_pb2.GenerateResponse(request_id=self.request_id if first else b"", token_ids=[r.token_id],
                                           text=text, finish_reason=finish, prompt_tokens=len(self.prompt))
        from_prefill, self._first_from_prefill = self._first_from_prefill, False
        if self.want_logprobs:
            if not from_prefill and not r.HasField("logprobs"):
                raise _missing(f"decode sent token {self.num_sent} without its log-probabilities")
            msg.logprobs.append(self.first_logprobs if from_prefill else r.logprobs)
        if first and self.prompt_logprobs is not None:
            msg.prompt_token_ids.extend(self.prompt)
            msg.prompt_logprobs.extend(self.prompt_logprobs)
        self.num_sent += 1
        return msg
