"""The scheduler's CPU per report (`report-cost`): one scripted worker decoding a batch on a
session; with --floor, what answering costs when nothing is scheduled."""

from __future__ import annotations

import asyncio
import secrets
import tempfile
import time
from pathlib import Path

import grpc

from bench.harness.fake_worker import (
    PROMPT,
    RPC_TIMEOUT,
    FakeWorker,
    channels,
    close_all,
    iterate_for,
    submit_many,
)
from bench.harness.processes import (
    Proc,
    checkouts,
    start_scheduler,
    start_scripted_workers,
    stop_all,
    wait_for_workers,
)
from bench.harness.tables import load_note, print_table
from bench.traffic.echo import start_echo
from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc


def _nano_cpu_per_decision(directory: str, batch: int, decisions: int = 200) -> float:
    from bench import decision_cost

    return decision_cost.cpu_per_decision("nano", batch, decisions, Path(directory))


def cmd_report_cost(args) -> None:
    """The scheduler process's CPU per report of one scripted worker decoding --batch
    sequences on a session: from /proc (utime + stime) over --seconds of
    steady decoding, the scheduler's idle CPU over the same wall time subtracted. With
    --before, the other checkout's scheduler and worker first, in the same run."""
    print(
        f"1 scripted worker (--step-ms {args.step_ms:g}, a session), {args.batch} sequences "
        f"decoding; the scheduler's CPU from /proc over {args.seconds:g} s, its idle CPU "
        f"(measured first, {args.idle_seconds:g} s) subtracted {load_note()}"
    )
    rows = [[label, *_report_cost(args, root)] for label, root in checkouts(args.before)]
    if args.floor:
        rows += _floor_rows(args)
    if args.nano_vllm:
        nano = _nano_cpu_per_decision(args.nano_vllm, args.batch)
        rows.append(
            ["nano-vllm schedule()+postprocess()", "200", f"{args.batch}", f"{nano * 1e3:.3f}", "-"]
        )
        for row in rows[:-1]:
            print(
                f"ratio, {row[0]}: {float(row[3]) / (nano * 1e3):.1f}x nano-vllm's CPU per decision"
            )
    print_table(["", "reports", "tokens/report", "CPU ms each", "idle (of a core)"], rows)


def _report_cost(args, root: Path) -> list[str]:
    """One version's row: reports, tokens per report, CPU ms per report, idle CPU."""
    scheduler = start_scheduler("--max-batch-size", str(args.batch), root=root)
    workers: list[Proc] = []
    try:
        cpu, wall = scheduler.proc.cpu_seconds(), time.perf_counter()
        time.sleep(args.idle_seconds)
        idle_cores = (scheduler.proc.cpu_seconds() - cpu) / (time.perf_counter() - wall)
        workers = start_scripted_workers(
            scheduler,
            1,
            "--step-ms",
            str(args.step_ms),
            "--max-batch-size",
            str(args.batch),
            "--gdn-slots",
            str(args.batch),
            "--kv-pages",
            "100000",
            root=root,
        )
        channel = grpc.insecure_channel(scheduler.target)
        stub = pb_grpc.SchedulerStub(channel)
        wait_for_workers(stub, 1)
        request = pb.SubmitRequest(prompt_token_ids=PROMPT, max_new_tokens=args.max_new_tokens)
        for _ in range(args.batch):
            stub.Submit(request, timeout=RPC_TIMEOUT)
        tokens = "lattice_scheduler_generation_tokens_total"
        reports = "lattice_scheduler_select_batch_duration_seconds_count"
        # Steady state: every sequence admitted and decoding for a while.
        wait_until(
            lambda: scheduler.metric(tokens) >= 20 * args.batch,
            "the worker to decode its batch",
            120,
            every_seconds=0.2,
        )
        count_0, tokens_0 = scheduler.metric(reports), scheduler.metric(tokens)
        cpu, wall = scheduler.proc.cpu_seconds(), time.perf_counter()
        time.sleep(args.seconds)
        cpu_1, wall_1 = scheduler.proc.cpu_seconds(), time.perf_counter()
        count, decoded = scheduler.metric(reports) - count_0, scheduler.metric(tokens) - tokens_0
        channel.close()
    finally:
        stop_all(*workers, scheduler.proc)
    if decoded >= args.batch * (args.max_new_tokens - 20):
        raise SystemExit("the sequences finished inside the window: raise --max-new-tokens")
    busy = (cpu_1 - cpu) - idle_cores * (wall_1 - wall)
    per_report = busy / count
    return [
        f"{count:.0f}",
        f"{decoded / count:.1f}",
        f"{per_report * 1e3:.3f}",
        f"{idle_cores * 100:.1f}%",
    ]


FLOOR_WORKER = "floor-0"


def _floor_rows(args) -> list[list[str]]:
    """Rows of one in-process worker on a session, paced like the scripted one (a report,
    its answer, --step-ms), reporting --batch running sequences with a token each in the
    project's worker's form (packed tokens, the running list left out when unchanged):
    to a bare echo servicer without interceptors, with the scheduler's, with the
    bearer-token check too, and to this scheduler, so that the rows differ only in what
    answers."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        token = secrets.token_urlsafe(24)
        tokens_path = Path(tmp) / "tokens.toml"
        tokens_path.write_text(
            f'[[tokens]]\ntoken = "{token}"\nrole = "worker"\nworker_id = "{FLOOR_WORKER}"\n'
        )
        for label, which, metadata in (
            ("echo servicer, no interceptors", "none", ()),
            ("echo servicer, the scheduler's interceptors", "default", ()),
            (
                "echo servicer, interceptors and --auth-tokens",
                "auth",
                (("authorization", f"Bearer {token}"),),
            ),
        ):
            proc, target = start_echo(
                "--new-form", "--interceptors", which, "--tokens", str(tokens_path)
            )
            try:
                rows.append(
                    [
                        f"{label} (in-process worker)",
                        *_paced_cost(args, proc, target, metadata, echo=True),
                    ]
                )
            finally:
                proc.stop()
    scheduler = start_scheduler("--max-batch-size", str(args.batch))
    try:
        rows.append(
            [
                "this scheduler (in-process worker)",
                *_paced_cost(args, scheduler.proc, scheduler.target, (), echo=False),
            ]
        )
    finally:
        scheduler.proc.stop()
    return rows


def _paced_cost(args, proc: Proc, target: str, metadata, echo: bool) -> list[str]:
    """A row of `_report_cost`'s columns for `proc` serving one paced in-process worker."""
    cpu, wall = proc.cpu_seconds(), time.perf_counter()
    time.sleep(args.idle_seconds)
    idle_cores = (proc.cpu_seconds() - cpu) / (time.perf_counter() - wall)
    count, busy = asyncio.run(_paced_session(args, proc, target, metadata, echo, idle_cores))
    return [
        f"{count}",
        f"{args.batch:.1f}",
        f"{busy / count * 1e3:.3f}",
        f"{idle_cores * 100:.1f}%",
    ]


async def _paced_session(
    args, proc: Proc, target: str, metadata, echo: bool, idle_cores: float
) -> tuple[int, float]:
    """(reports, the server's CPU seconds over them less its idle CPU) over --seconds."""
    [ch] = channels(target, 1)
    worker = FakeWorker(ch, FLOOR_WORKER, session=True, metadata=metadata, worker_form=True)
    await worker.register(args.batch, args.batch)
    if echo:
        worker.running = list(range(1, args.batch + 1))
        for seq_id in worker.running:
            worker._pending.admitted(seq_id)
    else:
        await submit_many(pb_grpc.SchedulerStub(ch), args.batch, args.max_new_tokens)
        for _ in range(100):
            if len(worker.running) >= args.batch:
                break
            await worker.admit(args.batch)
        if len(worker.running) < args.batch:
            raise SystemExit(f"the scheduler admitted {len(worker.running)} of {args.batch}")
    step = args.step_ms / 1000
    await iterate_for([worker], 2.0, args.batch, step_seconds=step)  # steady state first
    cpu, wall = proc.cpu_seconds(), time.perf_counter()
    latencies = await iterate_for([worker], args.seconds, args.batch, step_seconds=step)
    busy = (proc.cpu_seconds() - cpu) - idle_cores * (time.perf_counter() - wall)
    await close_all([worker], [ch])
    return len(latencies), busy
