"""A bounded demo load through the gateway: concurrent streamed chat completions sent with
the official `openai` client, progress while it runs, figures at the end (the same lines
as the gRPC load: common/loadgen.py). With `turns` > 1, conversations: each request
after a conversation's first carries the whole conversation so far (its earlier
questions and answers), as a chat client does, so its prompt starts with the previous
turn's and the scheduler can resume it from a worker's prefix cache."""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass

from common.loadgen import LoadReport, print_progress, run_concurrently

_QUESTIONS = [
    "What does the scheduler do?",
    "Explain paged attention in one line.",
    "Say hello in Japanese: こんにちは?",
    "Why do hybrid models keep a recurrent state?",
    "Count from one to five.",
    "What is a KV page?",
    "Name three cities: Zürich, …",
    "Tell me a short story about a queue.",
]
_FOLLOW_UPS = [
    "And then?",
    "Say that again, shorter.",
    "Why is that?",
    "Give an example.",
    "Thank you. Anything else?",
]


@dataclass
class HttpResult:
    """One request, filled while it streams (progress reads it live)."""

    ttft_seconds: float | None = None
    e2e_seconds: float = 0.0
    num_tokens: int = 0
    finish_reason: str = ""
    error: str = ""
    text: str = ""


@dataclass(frozen=True)
class HttpLoadSpec:
    num_requests: int = 24
    concurrency: int = 8
    max_new_tokens: int = 32
    seed: int = 0
    timeout_seconds: float = 300.0
    # Requests per conversation (1: independent requests); the last conversation may
    # have fewer, so that num_requests are sent in all.
    turns: int = 1

    @property
    def num_conversations(self) -> int:
        return -(-self.num_requests // self.turns)


def run_http_load(
    base_url: str, model: str, spec: HttpLoadSpec, progress=sys.stdout
) -> tuple[LoadReport, list[HttpResult]]:
    """Send spec.num_requests streamed chat completions to `base_url` (as conversations of
    spec.turns requests each), spec.concurrency conversations at a time; usage counts
    come from the server (stream_options.include_usage)."""
    import openai

    client = openai.OpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=spec.timeout_seconds
    )
    rng = random.Random(spec.seed)
    num_conversations, turns = spec.num_conversations, spec.turns
    # Each conversation opens with its own number, so that no two share a first prompt.
    openings = [
        f"({c + 1}) {rng.choice(_QUESTIONS)}" if turns > 1 else rng.choice(_QUESTIONS)
        for c in range(num_conversations)
    ]
    follow_ups = [
        [rng.choice(_FOLLOW_UPS) for _ in range(turns - 1)] for _ in range(num_conversations)
    ]
    results = [HttpResult() for _ in range(spec.num_requests)]
    wall = run_concurrently(
        num_conversations,
        spec.concurrency,
        lambda c: _conversation(
            client,
            model,
            [openings[c], *follow_ups[c]],
            c * turns,
            spec,
            results[c * turns : (c + 1) * turns],
        ),
        lambda elapsed: print_progress(results, elapsed, progress),
    )
    client.close()
    return LoadReport(wall, results), results


def _conversation(
    client,
    model: str,
    questions: list[str],
    first_index: int,
    spec: HttpLoadSpec,
    results: list[HttpResult],
) -> None:
    """One conversation, a turn at a time; it stops at the first failed turn (the turns
    after it count as failed too)."""
    messages: list[dict] = []
    for turn, (question, result) in enumerate(zip(questions, results)):
        messages.append({"role": "user", "content": question})
        _one(client, model, messages, first_index + turn, spec, result)
        if result.error:
            for later in results[turn + 1 :]:
                later.error = "not sent: an earlier turn of its conversation failed"
            return
        messages.append({"role": "assistant", "content": result.text})


def _one(
    client, model: str, messages: list[dict], index: int, spec: HttpLoadSpec, result: HttpResult
) -> None:
    import openai

    started = time.perf_counter()
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=spec.max_new_tokens,
            temperature=0.7,
            seed=spec.seed + index,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"Idempotency-Key": f"demo-{spec.seed}-{index}-{time.time_ns()}"},
        )
        pieces = []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if result.ttft_seconds is None:
                    result.ttft_seconds = time.perf_counter() - started
                pieces.append(chunk.choices[0].delta.content)
            if chunk.choices and chunk.choices[0].finish_reason:
                result.finish_reason = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                result.num_tokens = chunk.usage.completion_tokens
        result.text = "".join(pieces)
    except openai.APIError as err:
        result.error = f"{type(err).__name__}: {err}"
    result.e2e_seconds = time.perf_counter() - started
