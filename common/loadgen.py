"""A bounded demo load: concurrent Generate streams, progress while it runs, figures at the end."""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import grpc

from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class LoadSpec:
    """What to send: how many streams, how many at once, and their sizes."""

    num_requests: int = 24
    concurrency: int = 8
    min_prompt_len: int = 8
    max_prompt_len: int = 200
    max_new_tokens: int = 32
    max_token_id: int = 200
    seed: int = 0
    timeout_seconds: float = 300.0


@dataclass
class _Result:
    ttft_seconds: float | None = None
    e2e_seconds: float = 0.0
    num_tokens: int = 0
    finish_reason: str = ""
    error: str = ""


@dataclass
class LoadReport:
    """Figures of one run; every one measured by the client."""

    wall_seconds: float
    results: list[_Result] = field(default_factory=list)

    @property
    def ok(self) -> list[_Result]:
        return [r for r in self.results if not r.error]

    def lines(self) -> list[str]:
        ok = self.ok
        tokens = sum(r.num_tokens for r in ok)
        ttft = sorted(r.ttft_seconds for r in ok if r.ttft_seconds is not None)
        e2e = sorted(r.e2e_seconds for r in ok)
        out = [
            f"requests: {len(ok)} finished, {len(self.results) - len(ok)} failed, "
            f"in {self.wall_seconds:.2f} s",
            f"throughput: {tokens / self.wall_seconds:.1f} generated tokens/s, "
            f"{len(ok) / self.wall_seconds:.2f} requests/s",
        ]
        if ttft:
            out.append(
                f"time to first token: p50 {_ms(percentile(ttft, 50))}, p99 {_ms(percentile(ttft, 99))}"
            )
        if e2e:
            out.append(
                f"end-to-end latency:  p50 {_ms(percentile(e2e, 50))}, p99 {_ms(percentile(e2e, 99))}, "
                f"mean {_ms(statistics.fmean(e2e))}"
            )
        errors = sorted({r.error for r in self.results if r.error})
        out += [f"error: {e}" for e in errors[:5]]
        return out


def run_load(
    target: str, spec: LoadSpec, progress=sys.stdout, *, channel: grpc.Channel | None = None
) -> LoadReport:
    """Send spec.num_requests Generate streams, spec.concurrency at a time; print progress.

    `channel` (the caller's, with its TLS and token; left open) replaces a plaintext one to `target`.
    """
    rng = random.Random(spec.seed)
    prompts = [
        [
            rng.randrange(1, spec.max_token_id)
            for _ in range(rng.randint(spec.min_prompt_len, spec.max_prompt_len))
        ]
        for _ in range(spec.num_requests)
    ]
    own_channel = channel is None
    channel = grpc.insecure_channel(target) if own_channel else channel
    stub = pb_grpc.SchedulerStub(channel)
    results = [_Result() for _ in prompts]
    wall = run_concurrently(
        len(prompts),
        spec.concurrency,
        lambda index: _one(stub, prompts[index], spec, results[index]),
        lambda elapsed: print_progress(results, elapsed, progress),
    )
    if own_channel:
        channel.close()
    return LoadReport(wall, results)


def _one(stub: pb_grpc.SchedulerStub, prompt: list[int], spec: LoadSpec, result: _Result) -> None:
    """Run one stream, filling `result` as events arrive (progress reads it live)."""
    started = time.perf_counter()
    request = pb.SubmitRequest(prompt_token_ids=prompt, max_new_tokens=spec.max_new_tokens)
    try:
        for event in stub.Generate(request, timeout=spec.timeout_seconds):
            if event.token_ids and result.ttft_seconds is None:
                result.ttft_seconds = time.perf_counter() - started
            result.num_tokens += len(event.token_ids)
            if event.finished:
                result.finish_reason = pb.FinishReason.Name(event.finish_reason)
    except grpc.RpcError as err:
        result.error = f"{err.code().name}: {err.details()}"
    result.e2e_seconds = time.perf_counter() - started


def run_concurrently(
    count: int,
    concurrency: int,
    one: Callable[[int], None],
    progress: Callable[[float], None] | None = None,
    every_seconds: float = 1.0,
) -> float:
    """Call one(0) ... one(count - 1), `concurrency` at a time, and `progress(elapsed)`
    every `every_seconds` and once at the end; the wall seconds. An exception `one` did
    not handle is raised here once all calls ended."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max(1, min(concurrency, count)), thread_name_prefix="load") as pool:
        futures = [pool.submit(one, index) for index in range(count)]
        pending = set(futures)
        while pending:
            _, pending = wait(pending, timeout=every_seconds)
            if progress is not None:
                progress(time.perf_counter() - started)
    for future in futures:
        future.result()
    return time.perf_counter() - started


def print_progress(results, elapsed: float, out) -> None:
    finished = sum(1 for r in results if r.e2e_seconds)
    tokens = sum(r.num_tokens for r in results)
    print(
        f"  [{elapsed:5.1f} s] {finished}/{len(results)} requests done, {tokens} tokens so far",
        file=out,
        flush=True,
    )


def percentile(sorted_values: list[float], percent: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    index = min(len(sorted_values) - 1, max(0, round(percent / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"
