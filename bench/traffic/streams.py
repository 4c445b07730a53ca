"""Streams held open beside iterating workers: idle Generate streams (`streams`), streams
read to the end (`honest`), unauthenticated Health.Watch streams (`watch`)."""

from __future__ import annotations

import asyncio
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.harness.fake_worker import (
    PROMPT,
    FakeWorker,
    channels,
    close_all,
    iterate_for,
    submit_many,
)
from bench.harness.processes import (
    ROOT,
    Scheduler,
    checkouts,
    start_scheduler,
    start_scripted_workers,
    stop_all,
)
from bench.harness.tables import load_note, ms, pct, print_table
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc


def histogram_p99(before: dict[float, float], after: dict[float, float]) -> str:
    """The upper bound of the bucket holding the 99th percentile of what came in between."""
    total = after[float("inf")] - before.get(float("inf"), 0.0)
    for bound in sorted(after):
        if after[bound] - before.get(bound, 0.0) >= 0.99 * total:
            return "> 1000" if bound == float("inf") else f"<= {bound * 1000:g}"
    return "-"


async def _streams(scheduler: Scheduler, args) -> list[list[object]]:
    """Idle Generate streams next to iterating workers: SelectBatch before and after."""
    [ch] = channels(scheduler.target, 1)
    stub = pb_grpc.SchedulerStub(ch)
    await submit_many(stub, args.workers * args.batch)
    workers = [FakeWorker(ch, f"w{i}", session=True) for i in range(args.workers)]
    for w in workers:
        await w.register(args.batch, args.batch)
        await w.admit(args.batch)
    step = args.step_ms / 1000
    await iterate_for(workers, 1.0, args.batch, step_seconds=step)  # warm-up
    histogram_0 = scheduler.histogram()
    before = await iterate_for(workers, args.seconds, args.batch, step_seconds=step)
    histogram_1 = scheduler.histogram()
    rss_before = scheduler.proc.rss_bytes()

    stream_channels = channels(scheduler.target, max(1, args.streams // 500))
    request = pb.SubmitRequest(prompt_token_ids=PROMPT, max_new_tokens=16)
    calls = [
        pb_grpc.SchedulerStub(stream_channels[i % len(stream_channels)]).Generate(
            request, timeout=3600
        )
        for i in range(args.streams)
    ]
    opened = time.perf_counter()
    firsts = await asyncio.gather(*(c.read() for c in calls), return_exceptions=True)
    open_seconds = time.perf_counter() - opened
    num_open = sum(isinstance(f, pb.GenerateEvent) for f in firsts)
    await asyncio.sleep(1.0)
    rss_after = scheduler.proc.rss_bytes()
    histogram_2 = scheduler.histogram()
    during = await iterate_for(workers, args.seconds, args.batch, step_seconds=step)
    histogram_3 = scheduler.histogram()
    await close_all(workers, [ch, *stream_channels], calls)
    per_stream = (rss_after - rss_before) / max(1, num_open)
    return [
        [
            "no streams",
            0,
            len(before),
            ms(statistics.median(before)),
            ms(pct(before, 99)),
            histogram_p99(histogram_0, histogram_1),
            f"{rss_before / 2**20:.0f}",
            "-",
        ],
        [
            f"{num_open} idle streams",
            num_open,
            len(during),
            ms(statistics.median(during)),
            ms(pct(during, 99)),
            histogram_p99(histogram_2, histogram_3),
            f"{rss_after / 2**20:.0f}",
            f"{per_stream / 1024:.1f} (opened in {open_seconds:.1f} s)",
        ],
    ]


def cmd_streams(args) -> None:
    pace = (
        f"each step taking {args.step_ms:g} ms (as a GPU would)"
        if args.step_ms
        else "back to back (the scheduler saturated)"
    )
    print(
        f"{args.streams} idle Generate streams on one scheduler, {args.workers} workers "
        f"(sessions) iterating {pace}, each with {args.batch} running sequences and "
        f"one new token each per iteration; {args.seconds:g} s per row {load_note()}"
    )
    scheduler = start_scheduler(
        "--max-streams", str(args.streams + 100), "--max-batch-size", str(args.batch)
    )
    try:
        rows = asyncio.run(_streams(scheduler, args))
    finally:
        scheduler.proc.stop()
    print_table(
        [
            "",
            "streams",
            "SelectBatch calls",
            "p50 ms",
            "p99 ms",
            "server p99 ms",
            "server RSS MiB",
            "RSS per stream KiB",
        ],
        rows,
    )
    print(
        "p50, p99: round trips timed by the workers; server p99: the bucket of the "
        "scheduler's own histogram (from arrival, loop lag included)"
    )


async def _honest(
    target: str, num_streams: int, max_new_tokens: int, timeout: float
) -> tuple[int, int, float, list[float], list[str]]:
    chans = channels(target, max(1, num_streams // 500))
    request = pb.SubmitRequest(prompt_token_ids=PROMPT, max_new_tokens=max_new_tokens)
    e2e: list[float] = []
    errors: list[str] = []
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        started = time.perf_counter()
        try:
            call = pb_grpc.SchedulerStub(chans[i % len(chans)]).Generate(request, timeout=timeout)
            async for event in call:
                tokens += len(event.token_ids)
                if event.finished:
                    e2e.append(time.perf_counter() - started)
        except grpc.RpcError as err:
            errors.append(err.code().name)

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(num_streams)))
    wall = time.perf_counter() - started
    await close_all(chans=chans)
    return len(e2e), tokens, wall, e2e, errors


def cmd_honest(args) -> None:
    print(
        f"{args.streams} Generate streams at once, read to the end ({args.max_new_tokens} "
        f"tokens each), {args.workers} scripted worker processes (batch {args.batch}); "
        f"timeout {args.timeout:g} s {load_note()}"
    )
    rows = []
    for label, root in checkouts(args.before):
        # Another checkout's scheduler may not know --max-streams.
        flags = ("--max-streams", str(args.streams + 100)) if root == ROOT else ()
        scheduler = start_scheduler(*flags, root=root)
        workers = start_scripted_workers(
            scheduler,
            args.workers,
            "--max-batch-size",
            str(args.batch),
            "--gdn-slots",
            str(args.batch),
            "--kv-pages",
            "100000",
        )
        try:
            time.sleep(2.0)
            done, tokens, wall, e2e, errors = asyncio.run(
                _honest(scheduler.target, args.streams, args.max_new_tokens, args.timeout)
            )
        finally:
            stop_all(*workers, scheduler.proc)
        rows.append(
            [
                label,
                f"{done}/{args.streams}",
                tokens,
                f"{wall:.1f}",
                f"{tokens / wall:.0f}",
                f"{pct(e2e, 99):.2f}" if e2e else "-",
                ", ".join(f"{e} x{errors.count(e)}" for e in sorted(set(errors))) or "-",
            ]
        )
    print_table(["", "finished", "tokens", "wall s", "tokens/s", "e2e p99 s", "errors"], rows)


async def _watch(scheduler: Scheduler, args, worker_tokens: dict[str, str]) -> list[list]:
    [ch] = channels(scheduler.target, 1)
    workers = [
        FakeWorker(ch, w, session=True, metadata=(("authorization", f"Bearer {t}"),))
        for w, t in worker_tokens.items()
        if w != "admin"
    ]
    client = pb_grpc.SchedulerStub(ch)
    admin = (("authorization", f"Bearer {worker_tokens['admin']}"),)
    for w in workers:
        await w.register(args.batch, args.batch)
    await submit_many(client, len(workers) * args.batch, metadata=admin)
    for w in workers:
        await w.admit(args.batch)
    await iterate_for(workers, 1.0, args.batch)
    quiet = await iterate_for(workers, args.seconds, args.batch)
    watch_channels = channels(scheduler.target, max(1, args.watchers // 250))
    watches = [
        health_pb2_grpc.HealthStub(watch_channels[i % len(watch_channels)]).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=3600
        )
        for i in range(args.watchers)
    ]
    firsts = await asyncio.gather(*(w.read() for w in watches), return_exceptions=True)
    accepted = sum(isinstance(f, health_pb2.HealthCheckResponse) for f in firsts)
    refused = sum(
        isinstance(f, grpc.RpcError) and f.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        for f in firsts
    )
    loaded = await iterate_for(workers, args.seconds, args.batch)
    await close_all(workers, [ch, *watch_channels], watches)
    return [
        ["no watchers", "-", len(quiet), ms(statistics.median(quiet)), ms(pct(quiet, 99)), "1.00"],
        [
            f"{args.watchers} Health.Watch, no token",
            f"{accepted} open, {refused} refused",
            len(loaded),
            ms(statistics.median(loaded)),
            ms(pct(loaded, 99)),
            f"{pct(loaded, 99) / pct(quiet, 99):.2f}",
        ],
    ]


def cmd_watch(args) -> None:
    print(
        f"{args.watchers} Health.Watch streams without a token against a scheduler with "
        f"--auth-tokens, next to {args.workers} workers (tokens, sessions) iterating with "
        f"{args.batch} running each; {args.seconds:g} s per row {load_note()}"
    )
    names = [f"w{i}" for i in range(args.workers)]
    tokens = {name: secrets.token_urlsafe(24) for name in [*names, "admin"]}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokens.toml"
        path.write_text(
            "".join(
                f'[[tokens]]\ntoken = "{t}"\nrole = "worker"\nworker_id = "{n}"\n\n'
                for n, t in tokens.items()
                if n != "admin"
            )
            + f'[[tokens]]\ntoken = "{tokens["admin"]}"\nrole = "admin"\n'
        )
        scheduler = start_scheduler("--auth-tokens", str(path), "--max-batch-size", str(args.batch))
        try:
            rows = asyncio.run(_watch(scheduler, args, tokens))
        finally:
            scheduler.proc.stop()
    print_table(["", "watch streams", "SelectBatch calls", "p50 ms", "p99 ms", "p99 vs none"], rows)
