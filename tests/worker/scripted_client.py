"""A scheduler client for WorkerLoop tests without a server: it answers reports with
scripted decisions."""

from __future__ import annotations

import threading

from lattice.scheduler.v1 import scheduler_pb2 as pb
from worker_client.client import WorkerResources


class ScriptedClient:
    """Answers reports with `decisions` in order, then with empty decisions after setting
    `stop`; records every request."""

    def __init__(self, decisions, stop: threading.Event) -> None:
        self.requests: list[pb.SelectBatchRequest] = []
        self._decisions = list(decisions)
        self._stop = stop

    def register(self, resources: WorkerResources) -> pb.RegisterWorkerResponse:
        return pb.RegisterWorkerResponse(chunk_size=512, max_batch_size=8, lease_ttl_ms=10_000)

    def select(self, request: pb.SelectBatchRequest) -> pb.SchedulerDecision:
        self.requests.append(request)
        if len(self.requests) <= len(self._decisions):
            return self._decisions[len(self.requests) - 1]
        self._stop.set()
        return pb.SchedulerDecision()

    def deregister(self, worker_id: str) -> int:
        return 0
