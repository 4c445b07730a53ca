#!/usr/bin/env python3
"""What the OpenAI gateway costs: the same load as gRPC Generate streams straight to the
scheduler, and as streamed /v1/completions through the gateway, side by side.

Starts a scheduler, one worker and the gateway on loopback (free ports). The worker is the
scripted engine by default (no model: the figures are the scheduler's and the gateway's
own), `--model DIR` runs a real checkpoint instead. Both rows send the very same prompts
(random token ids, which /v1/completions accepts as a prompt), greedy, with the same stop
ids, so both generate the same tokens; the HTTP row adds tokenizing nothing, detokenizing
every token, JSON and server-sent events.

    python -m bench.gateway                         # 64 requests, 16 at a time
    python -m bench.gateway --requests 200 --concurrency 32 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.harness.tables import ms, pct, print_table
from common.loadgen import run_concurrently
from common.processes import (
    GATEWAY_LISTENING,
    LOOPBACK,
    gateway_argv,
    spawn,
    spawn_scheduler,
    worker_argv,
)
from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from worker_client.demo_model import build_tokenizer, write_tokenizer_files

ROOT = Path(__file__).resolve().parent.parent
START_SECONDS = 120.0  # a worker imports torch and loads its model
STOP_TOKEN_ID = 1  # the demo tokenizer's EOS, which the gateway always adds


@dataclass
class Row:
    name: str
    wall_seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    num_tokens: int = 0
    errors: list[str] = field(default_factory=list)


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gateway", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--min-prompt-len", type=int, default=8)
    parser.add_argument("--max-prompt-len", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--model",
        default="scripted",
        help="the worker's --model; a checkpoint dir also gives the gateway "
        "its tokenizer (default: scripted, with the demo tokenizer)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    prompts = [
        [
            rng.randrange(3, 200)
            for _ in range(rng.randint(args.min_prompt_len, args.max_prompt_len))
        ]
        for _ in range(args.requests)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_dir = Path(args.model) if args.model != "scripted" else workdir / "tokenizer"
        if args.model == "scripted":
            write_tokenizer_files(model_dir, build_tokenizer(512))
        procs = []
        try:
            scheduler = spawn_scheduler(
                "scheduler", workdir, cwd=ROOT, timeout_seconds=START_SECONDS
            )
            procs.append(scheduler)
            target = f"{LOOPBACK}:{scheduler.ports[0]}"
            worker = spawn(
                "worker",
                worker_argv(target, "bench-worker", args.model, "--device", "cpu"),
                workdir,
                cwd=ROOT,
            )
            procs.append(worker)
            gateway = spawn(
                "gateway",
                gateway_argv(target, model_dir),
                workdir,
                GATEWAY_LISTENING,
                cwd=ROOT,
                timeout_seconds=START_SECONDS,
            )
            procs.append(gateway)
            base_url = f"http://{LOOPBACK}:{gateway.ports[0]}"
            stub = pb_grpc.SchedulerStub(grpc.insecure_channel(target))
            wait_until(
                lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=5).workers,
                "the worker to register",
                START_SECONDS,
                every_seconds=0.1,
                gone=worker.exit_reason,
            )
            print(
                f"{args.requests} requests, {args.concurrency} at a time, prompts "
                f"{args.min_prompt_len}-{args.max_prompt_len} tokens, {args.max_new_tokens} "
                f"new tokens, worker --model {args.model}",
                flush=True,
            )
            rows = []
            for name, one in (
                ("gRPC Generate", _grpc_one(stub, args.max_new_tokens)),
                ("HTTP /v1/completions", _http_one(base_url, model_dir.name, args.max_new_tokens)),
            ):
                one(prompts[0], Row("warm-up"))
                rows.append(_run(name, one, prompts, args.concurrency))
            _print(rows)
            return 0 if not any(r.errors for r in rows) else 1
        finally:
            for proc in reversed(procs):
                proc.stop()


def _timed(row: Row, stream: Iterator[tuple[bool, int]]) -> None:
    """Read a stream of (a token came, tokens counted) to its end: its TTFT and e2e."""
    started = time.perf_counter()
    first = None
    for token_came, num_tokens in stream:
        if token_came and first is None:
            first = time.perf_counter() - started
        row.num_tokens += num_tokens
    row.ttft.append(first or 0.0)
    row.e2e.append(time.perf_counter() - started)


def _grpc_one(stub, max_new_tokens: int) -> Callable[[list[int], Row], None]:
    def one(prompt: list[int], row: Row) -> None:
        request = pb.SubmitRequest(
            prompt_token_ids=prompt, max_new_tokens=max_new_tokens, stop_token_ids=[STOP_TOKEN_ID]
        )
        try:
            _timed(
                row,
                (
                    (bool(e.token_ids), len(e.token_ids))
                    for e in stub.Generate(request, timeout=300)
                ),
            )
        except grpc.RpcError as err:
            row.errors.append(f"{err.code().name}: {err.details()}")

    return one


def _http_one(base_url: str, model: str, max_new_tokens: int) -> Callable[[list[int], Row], None]:
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)

    def one(prompt: list[int], row: Row) -> None:
        try:
            chunks = client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=max_new_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            _timed(
                row,
                (
                    (
                        bool(c.choices and c.choices[0].text),
                        c.usage.completion_tokens if c.usage is not None else 0,
                    )
                    for c in chunks
                ),
            )
        except openai.APIError as err:
            row.errors.append(f"{type(err).__name__}: {err}")

    return one


def _run(name: str, one, prompts: list[list[int]], concurrency: int) -> Row:
    row = Row(name)
    row.wall_seconds = run_concurrently(
        len(prompts), concurrency, lambda index: one(prompts[index], row)
    )
    return row


def _print(rows: list[Row]) -> None:
    print_table(
        ["path", "tokens", "tokens/s", "TTFT p50", "TTFT p99", "e2e p50", "e2e p99", "errors"],
        [
            [
                row.name,
                row.num_tokens,
                f"{row.num_tokens / row.wall_seconds:.0f}",
                _ms(row.ttft, 50),
                _ms(row.ttft, 99),
                _ms(row.e2e, 50),
                _ms(row.e2e, 99),
                len(row.errors),
            ]
            for row in rows
        ],
    )
    for row in rows:
        for error in sorted(set(row.errors))[:3]:
            print(f"{row.name}: {error}")


def _ms(values: list[float], percent: float) -> str:
    return f"{ms(pct(values, percent), 0)} ms" if values else "-"


if __name__ == "__main__":
    sys.exit(main())
