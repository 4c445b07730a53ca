"""The core's tables as one object: what every part of the core is handed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from service.core.observer import SchedulerObserver
from service.core.persist.changes import ChangeSet
from service.core.tables.ledger import WorkerLedger
from service.core.tables.queue import AdmissionQueue
from service.core.tables.sequences import SequenceTable
from service.core.tables.tenants import TenantLedger


@dataclass(frozen=True, slots=True)
class Tables:
    """The state a Scheduler holds, and what each change of it goes to: every part of
    the core that reads or writes a table (reconciler, batcher, lifecycle, recovery,
    worker registry) is handed this one object. The tables are mechanism: none of them
    reads the config."""

    sequences: SequenceTable  # every sequence by seq_id, finished ones for a while
    queue: AdmissionQueue  # the queued ones, in the policy's order
    ledger: WorkerLedger  # the registered workers and what each holds
    tenants: TenantLedger | None  # tenants' service; None: the order reads none
    changes: ChangeSet  # what changed since the last save
    observer: SchedulerObserver  # told of every change (metrics, wake-ups)
    clock: Callable[[], float]  # monotonic seconds
