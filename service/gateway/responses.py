"""The JSON of OpenAI answers: whole responses, stream chunks, usage, SSE framing."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from service.gateway.answers import Finish
from service.gateway.logprobs import ChatLogprobs, CompletionLogprobs


@dataclass(frozen=True)
class WholeChoice:
    """One choice of a whole (not streamed) answer; logprobs in the shape's form, or None."""

    text: str
    finish: Finish
    logprobs: dict | None = None


class CompletionShape:
    """The JSON of /v1/completions answers and chunks."""

    kind = "cmpl"

    def __init__(self, model: str, include_usage: bool) -> None:
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())

    def _envelope(self, seq_id: int, choices: list[dict], chunk: bool) -> dict:
        body = {
            "id": f"{self.kind}-{seq_id}",
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if chunk and self.include_usage:
            body["usage"] = None
        return body

    def logprobs_builder(self, decode, num_top: int) -> CompletionLogprobs:
        return CompletionLogprobs(decode, num_top)

    def whole(self, seq_id: int, choices: list[WholeChoice], num_prompt: int) -> dict:
        """The whole answer: one choice per WholeChoice, in index order."""
        body = self._envelope(
            seq_id,
            [self._whole_choice(index, choice) for index, choice in enumerate(choices)],
            chunk=False,
        )
        body["usage"] = _usage(num_prompt, sum(c.finish.num_completion_tokens for c in choices))
        return body

    def _whole_choice(self, index: int, choice: WholeChoice) -> dict:
        return {
            "index": index,
            "text": choice.text,
            "logprobs": choice.logprobs,
            "finish_reason": choice.finish.reason,
        }

    def first_chunk(self, seq_id: int, index: int = 0) -> dict | None:
        return None

    def chunk(
        self,
        seq_id: int,
        text: str,
        finish_reason: str | None = None,
        logprobs: dict | None = None,
        index: int = 0,
    ) -> dict:
        return self._envelope(
            seq_id,
            [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
            chunk=True,
        )

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

    def logprobs_builder(self, decode, num_top: int) -> ChatLogprobs:
        return ChatLogprobs(decode, num_top)

    def _whole_choice(self, index: int, choice: WholeChoice) -> dict:
        return {
            "index": index,
            "message": {"role": "assistant", "content": choice.text},
            "logprobs": choice.logprobs,
            "finish_reason": choice.finish.reason,
        }

    def first_chunk(self, seq_id: int, index: int = 0) -> dict | None:
        return self._envelope(
            seq_id,
            [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            chunk=True,
        )

    def chunk(
        self,
        seq_id: int,
        text: str,
        finish_reason: str | None = None,
        logprobs: dict | None = None,
        index: int = 0,
    ) -> dict:
        delta = {"content": text} if text or finish_reason is None else {}
        return self._envelope(
            seq_id,
            [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                }
            ],
            chunk=True,
        )


def _usage(num_prompt: int, num_completion: int) -> dict:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
    }


def sse_event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
