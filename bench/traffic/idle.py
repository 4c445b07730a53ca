"""What idle workers cost (`idle`): the scheduler's CPU with workers polling or parked on a
long poll, and how soon a Submit reaches a parked worker."""

from __future__ import annotations

import asyncio
import statistics
import time

from bench.harness.fake_worker import PROMPT, RPC_TIMEOUT, FakeWorker, channels, close_all
from bench.harness.processes import Scheduler, start_scheduler
from bench.harness.tables import load_note, ms, pct, print_table
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc


async def _idle(scheduler: Scheduler, args) -> list[list]:
    [ch] = channels(scheduler.target, 1)
    stub = pb_grpc.SchedulerStub(ch)
    workers = [FakeWorker(ch, f"idle{i}", session=True) for i in range(args.workers)]
    for w in workers:
        await w.register(8, 8)
    rows = []
    cpu, wall = scheduler.proc.cpu_seconds(), time.perf_counter()
    await asyncio.sleep(args.seconds)
    rows.append(["no workers calling", "-", _cores(scheduler, cpu, wall), "-", "-"])

    async def poll(w: FakeWorker, end: float, idle_wait_ms: int, pause: float) -> int:
        calls = 0
        while time.perf_counter() < end:
            await w.select(
                pb.SelectBatchRequest(
                    worker_id=w.worker_id,
                    kv_free_pages=1_000_000,
                    gdn_free_slots=8,
                    idle_wait_ms=idle_wait_ms,
                )
            )
            calls += 1
            if pause:
                await asyncio.sleep(pause)
        return calls

    for label, idle_wait_ms, pause in (
        ("polling every 10 ms (before)", 0, 0.01),
        ("long poll, idle_wait_ms 1000", 1000, 0.0),
    ):
        cpu, wall = scheduler.proc.cpu_seconds(), time.perf_counter()
        end = wall + args.seconds
        calls = await asyncio.gather(*(poll(w, end, idle_wait_ms, pause) for w in workers))
        rows.append(
            [
                f"{args.workers} idle workers, {label}",
                f"{sum(calls) / (time.perf_counter() - wall):.0f}",
                _cores(scheduler, cpu, wall),
                "-",
                "-",
            ]
        )

    # A Submit reaching one of the parked workers: from sending it to a worker holding it.
    latencies = []
    got: asyncio.Queue = asyncio.Queue()
    stop = asyncio.Event()

    async def park(w: FakeWorker) -> None:
        while not stop.is_set():
            decision = await w.select(
                pb.SelectBatchRequest(
                    worker_id=w.worker_id,
                    kv_free_pages=1_000_000,
                    gdn_free_slots=8,
                    idle_wait_ms=1000,
                    running=w.running,
                )
            )
            if decision.prefill:
                await got.put(time.perf_counter())
                w.running = []  # it "finished" at once: report nothing next time
                await w.select(
                    pb.SelectBatchRequest(
                        worker_id=w.worker_id,
                        kv_free_pages=1_000_000,
                        gdn_free_slots=8,
                        finished=[
                            pb.FinishedSequence(seq_id=c.seq_id, reason=2) for c in decision.prefill
                        ],
                    )
                )

    parked = [asyncio.create_task(park(w)) for w in workers]
    await asyncio.sleep(0.5)
    request = pb.SubmitRequest(prompt_token_ids=PROMPT, max_new_tokens=1)
    for _ in range(args.submits):
        sent = time.perf_counter()
        await stub.Submit(request, timeout=RPC_TIMEOUT)
        latencies.append(await asyncio.wait_for(got.get(), RPC_TIMEOUT) - sent)
        await asyncio.sleep(0.02)
    stop.set()
    await asyncio.gather(*parked, return_exceptions=True)
    rows.append(
        [
            f"Submit -> a parked worker holds it ({args.submits} submits)",
            "-",
            "-",
            ms(statistics.median(latencies)),
            ms(pct(latencies, 99)),
        ]
    )
    await close_all(workers, [ch])
    return rows


def _cores(scheduler: Scheduler, cpu_before: float, wall_before: float) -> str:
    used = scheduler.proc.cpu_seconds() - cpu_before
    return f"{100 * used / (time.perf_counter() - wall_before):.1f}%"


def cmd_idle(args) -> None:
    print(
        f"idle cost: {args.workers} workers with nothing to run (sessions), the "
        f"scheduler's CPU from /proc over {args.seconds:g} s per row {load_note()}"
    )
    scheduler = start_scheduler()
    try:
        rows = asyncio.run(_idle(scheduler, args))
    finally:
        scheduler.proc.stop()
    print_table(["", "calls/s", "scheduler CPU (of one core)", "p50 ms", "p99 ms"], rows)
