"""The JSON of OpenAI answers: whole responses, stream chunks, usage, SSE framing."""
from __future__ import annotations

import json
import time

from service.gateway.answers import Finish
from service.gateway.logprobs import ChatLogprobs, CompletionLogprobs


class CompletionShape:
    """The JSON of /v1/completions answers and chunks."""

    kind = "cmpl"

    def __init__(self, model: str, include_usage: bool) -> None:
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())

    def _envelope(self, seq_id: int, choices: list[dict], chunk: bool) -> dict:
        body = {"id": f"{self.kind}-{seq_id}", "object": "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if chunk and self.include_usage:
            body["usage"] = None
        return body

    def logprobs_builder(self, decode, num_top: int) -> CompletionLogprobs:
        return CompletionLogprobs(decode, num_top)

    def whole(self, seq_id: int, text: str, finish: Finish, num_prompt: int,
              logprobs: dict | None = None) -> dict:
        body = self._envelope(seq_id, [{"index": 0, "text": text, "logprobs": logprobs,
                                        "finish_reason": finish.reason}], chunk=False)
        body["usage"] = _usage(num_prompt, finish.num_completion_tokens)
        return body

    def first_chunk(self, seq_id: int) -> dict | None:
        return None

    def chunk(self, seq_id: int, text: str, finish_reason: str | None = None,
              logprobs: dict | None = None) -> dict:
        return self._envelope(seq_id, [{"index": 0, "text": text, "logprobs": logprobs,
                                        "finish_reason": finish_reason}], chunk=True)

    def usage_chunk(self, seq_id: int, finish: Finish, num_prompt: int) -> dict:
        body = self._envelope(seq_id, [], chunk=True)
        body["usage"] = _usage(num_prompt, finish.num_completion_tokens)
        return body


class ChatShape(CompletionShape):
    """The JSON of /v1/chat/completions answers and chunks."""

    kind = "chatcmpl"

    def _envelope(self, seq_id: int, choices: list[dict], chunk: bool) -> dict:
        body = super()._envelope(seq_id, choices, chunk)
        body["object"] = "chat.completion.chunk" if chunk else "chat.completion"
        return body

    def logprobs_builder(self, decode, num_top: int) -> ChatLogprobs:
        return ChatLogprobs(decode, num_top)

    def whole(self, seq_id: int, text: str, finish: Finish, num_prompt: int,
              logprobs: dict | None = None) -> dict:
        body = self._envelope(seq_id, [{
            "index": 0, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs, "finish_reason": finish.reason}], chunk=False)
        body["usage"] = _usage(num_prompt, finish.num_completion_tokens)
        return body

    def first_chunk(self, seq_id: int) -> dict | None:
        return self._envelope(seq_id, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}], chunk=True)

    def chunk(self, seq_id: int, text: str, finish_reason: str | None = None,
              logprobs: dict | None = None) -> dict:
        delta = {"content": text} if text or finish_reason is None else {}
        return self._envelope(seq_id, [{"index": 0, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": finish_reason}], chunk=True)


def _usage(num_prompt: int, num_completion: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion}


def sse_event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
