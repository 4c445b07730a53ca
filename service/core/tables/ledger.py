"""The worker ledger: who is registered, what each holds, and when each last called.

Mechanism only: it reads no config; the Scheduler hands it each worker's settings.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from service.core.errors import UnknownWorker
from service.core.cache.prefix_cache import FleetCache, ResumePoints
from service.core.types import WorkerRegistration, WorkerSettings

if TYPE_CHECKING:
    from service.core.tables.sequences import Sequence
    from service.core.tables.steady import SteadyRuns


@dataclass
class WorkerRecord:
    """One registered worker incarnation."""

    registration: WorkerRegistration
    settings: WorkerSettings
    last_call_at: float
    # Sequences assigned to this worker by seq_id, in assignment order: the record
    # itself (the sequence table's), so that a decision finds each in one lookup.
    assigned: dict[int, Sequence] = field(default_factory=dict)
    iteration: int = 0
    kv_free_pages: int = 0
    gdn_free_slots: int = 0
    draining: bool = False
    # Set by an operator (Scheduler.drain_worker): admit nothing new, whatever `draining`
    # (the worker's own last report) says.
    drain_requested: bool = False
    # Its prefix cache's resume points, from its reports (block_tokens 0: none are kept).
    resume_points: ResumePoints = field(default_factory=lambda: ResumePoints(0))
    # Its latest report's packed runs when they were one token for each of the
    # sequences they named (service/core/tables/steady.py): the next such report
    # is checked against it instead of sequence by sequence. Cleared at every admission
    # to this worker; a sequence that left `assigned` makes it fail its check.
    steady_runs: SteadyRuns | None = None

    @property
    def worker_id(self) -> str:
        return self.registration.worker_id

    @property
    def incarnation(self) -> int:
        return self.settings.incarnation

    def can_run(self, adapter_id: str) -> bool:
        return not adapter_id or adapter_id in self.registration.adapters

    @property
    def admitting(self) -> bool:
        """Whether it admits new sequences now (not drained, by itself or an operator)."""
        return not (self.draining or self.drain_requested)


def no_worker_has(adapter_id: str) -> str:
    """Why a queued sequence waits although workers may be idle: no registered worker
    that an operator has not drained has its adapter (SequenceInfo.error_message)."""
    return (f"waiting for a worker with adapter_id {adapter_id!r}: no live worker has it "
            f"(none registered with it, or every one drained by an operator)")


class WorkerLedger:
    """Registered workers by id, and which worker each assigned sequence is on."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerRecord] = {}
        # Every registered worker's resume points, by block hash (kept by ResumePoints).
        self.fleet_cache = FleetCache()

    def __iter__(self) -> Iterator[WorkerRecord]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def get(self, worker_id: str) -> WorkerRecord:
        """The registered worker, or UnknownWorker."""
        worker = self._workers.get(worker_id)
        if worker is None:
            raise UnknownWorker(
                f"worker_id {worker_id!r} is not registered (never, or its lease expired): "
                "call RegisterWorker first"
            )
        return worker

    def find(self, worker_id: str) -> WorkerRecord | None:
        return self._workers.get(worker_id)

    def add(self, record: WorkerRecord) -> None:
        assert record.worker_id not in self._workers
        self._workers[record.worker_id] = record

    def remove(self, worker_id: str) -> WorkerRecord | None:
        record = self._workers.pop(worker_id, None)
        if record is not None:
            record.resume_points.release()  # its points leave the fleet's index with it
        return record

    def expired(self, now: float) -> list[WorkerRecord]:
        """Workers whose last call is older than their lease."""
        return [
            w for w in self._workers.values()
            if (now - w.last_call_at) * 1000.0 > w.settings.lease_ttl_ms
        ]

    def num_assigned(self) -> int:
        return sum(len(w.assigned) for w in self._workers.values())
