"""A bounded demo load through the gateway: concurrent streamed chat completions sent with
the official `openai` client, progress while it runs, figures at the end (the same lines
as the gRPC load: common/loadgen.py)."""
from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass

from common.loadgen import LoadReport, print_progress, run_concurrently

_QUESTIONS = ["What does the scheduler do?", "Explain paged attention in one line.",
              "Say hello in Japanese: こんにちは?", "Why do hybrid models keep a recurrent state?",
              "Count from one to five.", "What is a KV page?", "Name three cities: Zürich, …",
              "Tell me a short story about a queue."]


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


def run_http_load(base_url: str, model: str, spec: HttpLoadSpec,
                  progress=sys.stdout) -> tuple[LoadReport, list[HttpResult]]:
    """Send spec.num_requests streamed chat completions to `base_url`, spec.concurrency at a
    time; usage counts come from the server (stream_options.include_usage)."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                           timeout=spec.timeout_seconds)
    rng = random.Random(spec.seed)
    questions = [rng.choice(_QUESTIONS) for _ in range(spec.num_requests)]
    results = [HttpResult() for _ in questions]
    wall = run_concurrently(
        len(questions), spec.concurrency,
        lambda index: _one(client, model, questions[index], index, spec, results[index]),
        lambda elapsed: print_progress(results, elapsed, progress))
    client.close()
    return LoadReport(wall, results), results


def _one(client, model: str, question: str, index: int, spec: HttpLoadSpec,
         result: HttpResult) -> None:
    import openai

    started = time.perf_counter()
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}],
            max_tokens=spec.max_new_tokens, temperature=0.7, seed=spec.seed + index,
            stream=True, stream_options={"include_usage": True},
            extra_headers={"Idempotency-Key": f"demo-{spec.seed}-{index}-{time.time_ns()}"})
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
