"""The running list each worker last sent in full, so that a steady report need not repeat
it (docs/contract.md, "Unchanged running lists").

A report sends `running` in full, or leaves it empty and names with
`running_unchanged_since` the iteration of the decision that answered the report in which
it last sent it. Only a full list sets the baseline, kept with the decision's iteration
and the worker's incarnation; an unchanged report changes nothing here. So a report sent
twice (an answer lost, the report retried on a new session) names a baseline that is
still held, and one that names anything else (a restart, another replica, a registration
since) finds none: the scheduler then applies nothing and asks for the list.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from lattice.scheduler.v1 import scheduler_pb2 as pb
from service.core.types import Decision
from service.server import convert


@dataclass(frozen=True, slots=True)
class _Baseline:
    incarnation: int
    iteration: int
    running: tuple[int, ...]


class RunningLists:
    """Per worker: the running list of its latest full report that was answered."""

    def __init__(self) -> None:
        self._baselines: dict[str, _Baseline] = {}

    def running(self, request: pb.SelectBatchRequest) -> tuple[int, ...] | None:
        """The running list `request` stands for; None when it names one not held here."""
        since = request.running_unchanged_since
        if not since:
            return tuple(request.running)
        baseline = self._baselines.get(request.worker_id)
        if (
            baseline is None
            or baseline.iteration != since
            or baseline.incarnation != request.incarnation
            or request.running
        ):
            return None
        return baseline.running

    def answer(
        self, request: pb.SelectBatchRequest, running: tuple[int, ...], decision: Decision
    ) -> pb.SchedulerDecision:
        """The answer to `request` (its running list `running`): `decision`, its decode
        list left out when it is `running` and the worker takes it so; a full list becomes
        the worker's baseline, under the decision's iteration."""
        if not request.running_unchanged_since:
            self._baselines[request.worker_id] = _Baseline(
                request.incarnation, decision.iteration, running
            )
        return convert.decision(
            decision,
            request.accepts_decode_all_running and bool(running) and decision.decode == running,
        )

    def forget(self, worker_id: str) -> None:
        """The worker registered again, left, or its lease expired."""
        self._baselines.pop(worker_id, None)

    def keep_only(self, worker_ids: Collection[str]) -> None:
        """Forget every worker not in `worker_ids` (the registered ones): a lease that
        expired during another worker's call leaves no baseline behind."""
        for worker_id in self._baselines.keys() - worker_ids:
            del self._baselines[worker_id]

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._baselines
