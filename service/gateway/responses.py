"""The JSON of OpenAI answers: whole responses, stream chunks, usage, SSE framing."""
from __future__ import annotations

import json
import time

from service.gateway.answers import Finish


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

    def whole(self, seq_id: int, choices: list[tuple[str, Finish]], num_prompt: int) -> dict:
        """The whole answer: one choice per (text, finish), in index order."""
        body = self._envelope(seq_id, [self._whole_choice(index, text, finish)
                                       for index, (text, finish) in enumerate(choices)],
                              chunk=False)
        body["usage"] = _usage(num_prompt, sum(f.num_completion_tokens for _, f in choices))
        return body

    def _whole_choice(self, index: int, text: str, finish: Finish) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish.reason}

    def first_chunk(self, seq_id: int, index: int = 0) -> dict | None:
        return None

    def chunk(self, seq_id: int, text: str, finish_reason: str | None = None,
              index: int = 0) -> dict:
        return self._envelope(seq_id, [{"index": index, "text": text, "logprobs": None,
                                        "finish_reason": finish_reason}], chunk=True)

    def usage_chunk(self, seq_id: int, num_completion: int, num_prompt: int) -> dict:
        """The last chunk with `stream_options.include_usage`: every choice's tokens."""
        body = self._envelope(seq_id, [], chunk=True)
        body["usage"] = _usage(num_prompt, num_completion)
        return body


class ChatShape(CompletionShape):
    """The JSON of /v1/chat/completions answers and chunks."""

    kind = "chatcmpl"

    def _envelope(self, seq_id: int, choices: list[dict], chunk: bool) -> dict:
        body = super()._envelope(seq_id, choices, chunk)
        body["object"] = "chat.completion.chunk" if chunk else "chat.completion"
        return body

    def _whole_choice(self, index: int, text: str, finish: Finish) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": finish.reason}

    def first_chunk(self, seq_id: int, index: int = 0) -> dict | None:
        return self._envelope(seq_id, [{"index": index,
                                        "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}], chunk=True)

    def chunk(self, seq_id: int, text: str, finish_reason: str | None = None,
              index: int = 0) -> dict:
        delta = {"content": text} if text or finish_reason is None else {}
        return self._envelope(seq_id, [{"index": index, "delta": delta, "logprobs": None,
                                        "finish_reason": finish_reason}], chunk=True)


def _usage(num_prompt: int, num_completion: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion}


def sse_event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
