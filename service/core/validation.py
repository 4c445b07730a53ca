"""Checks of a worker's calls, before the core changes anything."""
from __future__ import annotations

from service.core.errors import InvalidArgument, Superseded, UnknownWorker
from service.core.ledger import WorkerRecord
from service.core.types import WorkerReport


def check_incarnation(worker: WorkerRecord, incarnation: int) -> None:
    """Refuse a call from an incarnation other than the registered one (0: the latest)."""
    if incarnation in (0, worker.incarnation):
        return
    if incarnation < worker.incarnation:
        raise Superseded(
            f"superseded: worker_id {worker.worker_id!r} incarnation {incarnation} was "
            f"replaced by incarnation {worker.incarnation} (a later RegisterWorker with the "
            "same worker_id: two processes share it); this call changed nothing"
        )
    raise UnknownWorker(
        f"worker_id {worker.worker_id!r} incarnation {incarnation} is unknown here (the "
        f"registered one is {worker.incarnation}; the scheduler's state is older than that "
        "registration): call RegisterWorker again"
    )


def validate_report(report: WorkerReport, max_batch_size: int) -> None:
    """Reject contradictory or oversized reports before any state changes."""
    limit = 2 * max_batch_size
    for field_name, num in (("waiting + running", len(report.waiting) + len(report.running)),
                            ("finished", len(report.finished)),
                            ("preempted", len(report.preempted)),
                            ("tokens", len(report.tokens))):
        if num > limit:
            raise InvalidArgument(
                f"{field_name} holds {num} entries; a worker with max_batch_size "
                f"{max_batch_size} may report at most {limit}"
            )
    seen: set[int] = set()
    for field_name, ids in (("waiting", report.waiting), ("running", report.running)):
        for seq_id in ids:
            if seq_id in seen:
                raise InvalidArgument(
                    f"seq_id {seq_id} appears more than once in waiting/running "
                    f"(second time in {field_name})"
                )
            seen.add(seq_id)
    for fin in report.finished:
        if fin.seq_id in seen:
            raise InvalidArgument(f"seq_id {fin.seq_id} is reported both finished and active")
    for seq_id in report.preempted:
        if seq_id in seen:
            raise InvalidArgument(f"seq_id {seq_id} is reported both preempted and active")
