"""Decisions/s (`decisions`): workers in this process reporting back to back to a bare echo
servicer, then to each scheduler, unary and on a session."""

from __future__ import annotations

import asyncio
import statistics
import time

from bench.harness.fake_worker import FakeWorker, channels, close_all, iterate_for, submit_many
from bench.harness.processes import checkouts, start_scheduler
from bench.harness.tables import load_note, print_table
from bench.traffic.echo import start_echo
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc


async def _decisions(target: str, args, session: bool, echo: bool) -> tuple[int, float]:
    chans = channels(target, 4)
    workers = [
        FakeWorker(chans[i % len(chans)], f"d{i}", session, worker_form=True)
        for i in range(args.workers)
    ]
    for w in workers:
        await w.register(args.batch, args.batch)
    if echo:
        for i, w in enumerate(workers):
            w.running = list(range(i * args.batch + 1, (i + 1) * args.batch + 1))
    else:
        await submit_many(pb_grpc.SchedulerStub(chans[0]), args.workers * args.batch)
        for w in workers:
            await w.admit(args.batch)
    await iterate_for(workers, 1.0, args.batch)
    started = time.process_time()
    latencies = await iterate_for(workers, args.seconds, args.batch)
    client_cpu = time.process_time() - started
    await close_all(workers, chans)
    return len(latencies), client_cpu


def cmd_decisions(args) -> None:
    print(
        f"decisions/s: {args.workers} workers in this process, each reporting "
        f"{args.batch} running sequences with a token each and waiting for its decision, "
        f"back to back, {args.seconds:g} s per run, each report in the form the project's "
        f"worker sends to that scheduler; {args.rounds} rounds, each running "
        f"every row once in turn, so that the machine's load falls on all rows alike "
        f"{load_note()}"
    )
    runs = [
        ("bare echo servicer, unary", "echo", False),
        ("bare echo servicer, session", "echo", True),
    ]
    runs += [
        (f"{label}, {way}", root, session)
        for label, root in checkouts(args.before)
        for way, session in (("unary", False), ("session", True))
    ]
    rates: dict[str, list[float]] = {label: [] for label, _, _ in runs}
    cores: dict[str, list[float]] = {label: [] for label, _, _ in runs}
    for _ in range(args.rounds):
        for label, root, session in runs:
            rate, server_cores = _decisions_run(args, root, session)
            rates[label].append(rate)
            cores[label].append(server_cores)
    rows = [
        [
            label,
            " ".join(f"{r:.0f}" for r in rates[label]),
            f"{statistics.median(rates[label]):.0f}",
            f"{max(rates[label]):.0f}",
            f"{statistics.median(cores[label]):.2f}",
        ]
        for label, _, _ in runs
    ]
    print_table(["", "decisions/s per round", "median", "best", "server cores (median)"], rows)


def _decisions_run(args, root, session: bool) -> tuple[float, float]:
    if root == "echo":
        proc, target = start_echo()
    else:
        # The same policy (budget) for every version, so that the rows compare the path.
        scheduler = start_scheduler(
            "--max-batch-size", str(args.batch), "--policy", "budget", root=root
        )
        proc, target = scheduler.proc, scheduler.target
    try:
        cpu_before, wall_before = proc.cpu_seconds(), time.perf_counter()
        count, _ = asyncio.run(_decisions(target, args, session, root == "echo"))
        server_cores = (proc.cpu_seconds() - cpu_before) / (time.perf_counter() - wall_before)
    finally:
        proc.stop()
    return count / args.seconds, server_cores
