"""A gateway stack as tests and benchmarks start it: a scheduler, its workers and the
gateway, each its own process (common/processes.py), ready once the workers have said so,
and every process stopped on the way out."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from common.processes import (
    GATEWAY_LISTENING,
    LOOPBACK,
    SCHEDULER_LISTENING,
    START_TIMEOUT_SECONDS,
    Process,
    gateway_argv,
    scheduler_argv,
    spawn,
    worker_argv,
)
from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class GatewayStack:
    scheduler: Process
    workers: list[Process]
    gateway: Process
    channel: grpc.Channel  # to the scheduler

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.gateway.ports[0]}"

    @property
    def metrics_port(self) -> int:
        return self.scheduler.ports[1]

    @property
    def stub(self) -> pb_grpc.SchedulerStub:
        return pb_grpc.SchedulerStub(self.channel)


def first_exit(processes: Sequence[Process]) -> str | None:
    """Why the first of `processes` to have exited did, or None (for `wait_until`'s
    `gone`: a wait on them fails at once)."""
    return next((r for p in processes if (r := p.exit_reason()) is not None), None)


@contextmanager
def gateway_stack(
    logs: Path,
    model: Path,
    *,
    scheduler_flags: Sequence[str] = (),
    workers: Sequence[tuple[str, Sequence[str]]] = (),
    gateway_flags: Sequence[str] = (),
    ready: Callable[[Sequence[pb.WorkerStatus]], bool] | None = None,
    what: str = "every worker to register",
) -> Iterator[GatewayStack]:
    """`serve` with `scheduler_flags`, a worker per (worker id, flags) of `workers` on
    `model`, and the gateway tokenizing with `model` plus `gateway_flags`, their logs in
    `logs`. With workers, it yields once `ready(GetStatus's workers)` holds (by default:
    all registered); a process that exits meanwhile fails the wait at once."""
    started: list[Process] = []
    channel = None
    try:
        scheduler = spawn("scheduler", scheduler_argv(*scheduler_flags), logs, SCHEDULER_LISTENING)
        started.append(scheduler)
        target = f"{LOOPBACK}:{scheduler.ports[0]}"
        for worker_id, flags in workers:
            argv = worker_argv(target, worker_id, model, *flags)
            started.append(spawn(worker_id, argv, logs))
        argv = gateway_argv(target, model, *gateway_flags)
        gateway = spawn("gateway", argv, logs, GATEWAY_LISTENING)
        started.append(gateway)
        channel = grpc.insecure_channel(target)
        stack = GatewayStack(scheduler, started[1:-1], gateway, channel)
        if workers:
            done = ready or (lambda statuses: len(statuses) >= len(workers))
            wait_until(
                lambda: done(stack.stub.GetStatus(pb.GetStatusRequest(), timeout=10).workers),
                what,
                START_TIMEOUT_SECONDS,
                gone=lambda: first_exit(started),
            )
        yield stack
    finally:
        if channel is not None:
            channel.close()
        for process in reversed(started):
            process.stop()
