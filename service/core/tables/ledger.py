"""The worker ledger: who is registered, what each holds, and when each last called.

Mechanism only: it reads no config; the Scheduler hands it each worker's settings.
"""

from __future__ import annotations

from array import array
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from service.core.cache.prefix_cache import FleetCache, ResumePoints
from service.core.errors import UnknownWorker
from service.core.types import WorkerRegistration, WorkerSettings

if TYPE_CHECKING:
    from service.core.tables.sequences import Sequence


@dataclass(slots=True)
class SteadyRuns:
    """A worker's latest packed runs that gave each sequence they named one token, with
    what applying the same step again needs (WorkerRecord.steady_runs). Read and written
    only by service/core/tables/steady.py's SteadyStep.

    It holds while the same records stay assigned to the worker under the same
    admissions: `seqs` is compared by identity with what `assigned` holds for `seq_ids`
    (a sequence that left is None there, a restored one another record), and it is
    dropped at every admission to the worker (offsets count from 0 again). Tokens are
    added to these sequences only by this worker's reports, so `num_known` stays right
    as long as it is updated with each step applied from it.
    """

    seq_ids: Collection[int]
    seqs: list[Sequence]
    outputs: list[array]  # each one's output_token_ids
    num_known: list[int]  # each one's tokens since its admission: the next offsets
    grown: dict[int, Sequence]
    ones: list[int]  # one token each, as the observer hears it
    served: dict[str, int]  # tokens per tenant of one such step
    # Steady steps applied from it since `page_residues` was set.
    num_steps: int = 0
    # The decision's part, set by a decision whose report ran exactly these sequences in
    # this order, all DECODING: the report's running ids, the records, and how many of
    # them had each residue of (tokens - 1) % page_size then. Each steady step adds one
    # token to every one of them, so the number that start a page at the next decode is
    # page_residues[-num_steps % page_size].
    running_ids: Collection[int] | None = None
    running_seqs: tuple[Sequence, ...] = ()
    page_residues: list[int] | None = None


@dataclass(slots=True)
class CallGaps:
    """How long a busy worker takes to call again (its step, its report's round trip, its
    wake-up), smoothed as TCP smooths round-trip times (RFC 6298): how long another worker
    may wait for this one to ask. Read by the placement (FleetView); 0 until measured."""

    last_call_at: float | None = None
    mean_seconds: float = 0.0
    deviation_seconds: float = 0.0

    def called(self, now: float, busy: bool) -> None:
        """A call at `now` (the scheduler's clock); `busy`: the worker held sequences
        since its previous call, so it ran steps between the two and the gap counts (an
        idle worker's gap is the time it had nothing to do)."""
        last, self.last_call_at = self.last_call_at, now
        if not busy or last is None:
            return
        gap = now - last
        if not self.mean_seconds:
            self.mean_seconds, self.deviation_seconds = gap, gap / 2
            return
        self.deviation_seconds += (abs(gap - self.mean_seconds) - self.deviation_seconds) / 4
        self.mean_seconds += (gap - self.mean_seconds) / 8

    def bound_seconds(self) -> float:
        """How long its next call may take: the mean gap and four deviations (TCP's
        retransmission timeout, which few gaps exceed)."""
        return self.mean_seconds + 4 * self.deviation_seconds


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
    # When it called, and how long it takes to call again while busy.
    call_gaps: CallGaps = field(default_factory=CallGaps)

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
    return (
        f"waiting for a worker with adapter_id {adapter_id!r}: no live worker has it "
        f"(none registered with it, or every one drained by an operator)"
    )


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
            w
            for w in self._workers.values()
            if (now - w.last_call_at) * 1000.0 > w.settings.lease_ttl_ms
        ]

    def num_assigned(self) -> int:
        return sum(len(w.assigned) for w in self._workers.values())

    def num_busy(self) -> int:
        """Workers that hold sequences (each reports every step it runs)."""
        return sum(1 for w in self._workers.values() if w.assigned)
