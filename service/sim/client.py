"""The worker's side of the wire, in process: WorkerLoop's client calling a Scheduler directly.

Every call goes through service/server/convert.py, the same message mapping the servicer uses,
so a simulation exercises the wire mapping too; only the network and its retries are
left out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc

from lattice.scheduler.v1 import scheduler_pb2 as pb
from service.core import Scheduler, UnknownWorker
from service.core.types import WorkerReport
from service.server import convert
from service.server.running_lists import RunningLists
from worker_client import convert as worker_convert
from worker_client.client import NotRegistered
from worker_client.resources import WorkerResources


@dataclass
class ClientCounts:
    """What crossed this client, for the simulator's report."""

    engine_preemptions: int = 0  # reported by the worker (out of pages or slots)
    scheduler_preemptions: int = 0  # chosen by the scheduler (decision.preempt)
    cache_misses: int = 0  # first chunks whose resume point the worker no longer had


class InProcessClient:
    """Offers SchedulerClient's interface (register, select, deregister) to a WorkerLoop."""

    def __init__(
        self, scheduler: Scheduler, on_report: Callable[[WorkerReport], None] | None = None
    ) -> None:
        """`on_report`: sees every report as the scheduler gets it (a router's feed of the
        workers' cache events)."""
        self.scheduler = scheduler
        self.counts = ClientCounts()
        self.on_report = on_report
        self._running_lists = RunningLists()  # as the server keeps them

    def register(self, resources: WorkerResources) -> pb.RegisterWorkerResponse:
        request = worker_convert.register_request(resources)
        settings = self.scheduler.register_worker(convert.worker_registration(request))
        self._running_lists.forget(resources.worker_id)
        return convert.worker_settings(settings)

    def select(self, request: pb.SelectBatchRequest) -> pb.SchedulerDecision:
        running = self._running_lists.running(request)
        if running is None:
            return convert.running_needed()
        report = convert.worker_report(request, running)
        self.counts.engine_preemptions += len(report.preempted) + sum(
            1 for f in report.finished if f.reason.name == "PREEMPTED"
        )
        self.counts.cache_misses += len(report.cache_misses)
        if self.on_report is not None:
            self.on_report(report)
        try:
            decision = self._running_lists.answer(
                request, running, self.scheduler.select_batch(report)
            )
        except UnknownWorker as err:
            raise NotRegistered(
                "SelectBatch", grpc.StatusCode.FAILED_PRECONDITION, str(err)
            ) from None
        self.counts.scheduler_preemptions += len(decision.preempt)
        return decision

    def deregister(self, worker_id: str) -> int:
        self._running_lists.forget(worker_id)
        return self.scheduler.deregister_worker(worker_id)

    def close(self) -> None:
        """Nothing to close (SchedulerClient's interface)."""
