"""A sequence's moves that several parts of the core make: back to the queue, finished,
forgotten (another replica owns it now), and the tokens served on the way.

Shared by the Scheduler (reports, workers leaving, cancels), the Batcher (preemptions)
and recovery (orphans), so that none of them calls back into another.
"""

from __future__ import annotations

from collections.abc import Iterable

from service.core.observer import RequeueReason
from service.core.tables.ledger import WorkerRecord
from service.core.tables.sequences import Sequence
from service.core.tables.tables import Tables
from service.core.types import FinishReason, SequenceState


class Lifecycle:
    """Moves sequences between the queue, the workers and the finished, over the core's
    tables, marking each change for the next save and telling the observer."""

    def __init__(self, tables: Tables) -> None:
        self._sequences = tables.sequences
        self._queue = tables.queue
        self._ledger = tables.ledger
        self._changes = tables.changes
        self._observer = tables.observer
        self._tenants = tables.tenants
        self._clock = tables.clock

    def requeue(self, worker: WorkerRecord, seq_ids: list[int], reason: RequeueReason) -> list[int]:
        """Take `seq_ids` from `worker` and put them back in the queue (FCFS: at the head,
        in order); returns the ids that went back to the queue (see `back_to_queue`)."""
        for seq_id in seq_ids:
            del worker.assigned[seq_id]
        return self.back_to_queue(seq_ids, worker.worker_id, reason)

    def back_to_queue(self, seq_ids: list[int], worker_id: str, reason: RequeueReason) -> list[int]:
        """Queue sequences no worker holds again; returns those queued. One that already
        generated max_new_tokens has nothing left to resume: it finishes with MAX_LENGTH
        instead (its resume spec would ask for <= 0 tokens)."""
        requeued = []
        for seq_id in seq_ids:
            seq = self._sequences.get(seq_id)
            seq.num_generated = len(seq.output_token_ids)
            if seq.num_generated >= seq.params.max_new_tokens:
                self.finish(seq, FinishReason.MAX_LENGTH)
                continue
            requeued.append(seq)
            seq.state = SequenceState.QUEUED
            seq.worker_id = None
            seq.cursor = seq.prefilled_tokens = 0
            # Progress known only as a count cannot be resumed: restart from the tokens kept
            # (num_generated was reset to len(output_token_ids) above).
            seq.enqueued_at = self._clock()
            self._changes.touched(seq)
            self._observer.on_requeued(seq_id, worker_id, reason)
        if requeued:
            self._queue.requeue(requeued)
            self.queue_changed()
        return [seq.seq_id for seq in requeued]

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        self._changes.forgotten(self._sequences.mark_finished(seq, reason))
        self._changes.touched(seq)
        if self._tenants is not None:
            self._tenants.deactivate(seq.tenant)
        self._observer.on_finished(seq.seq_id, reason)

    def forget(self, seq_ids: Iterable[int]) -> None:
        """Forget sequences another replica owns now, or that went back to the shared
        queue: off the queue and the workers, out of the table, unsaved changes dropped.
        Nothing is finished or requeued; observers hear which (`on_disowned`)."""
        ids = frozenset(seq_ids)
        dropped = []
        for seq_id in ids:
            seq = self._sequences.drop(seq_id)
            if seq is None:
                continue
            dropped.append(seq_id)
            self._queue.remove(seq_id)
            worker = self._ledger.find(seq.worker_id or "")
            if worker is not None:
                worker.assigned.pop(seq_id, None)
            if not seq.is_finished and self._tenants is not None:
                self._tenants.deactivate(seq.tenant)
        self._changes.discard(ids)
        self.queue_changed()
        if dropped:
            self._observer.on_disowned(frozenset(dropped))

    def serve(self, served: dict[str, int]) -> None:
        """Count tokens served per tenant (the fair order's counters, and metrics)."""
        for tenant, num_tokens in served.items():
            if not num_tokens:
                continue
            if self._tenants is not None:
                self._changes.tenant_served(tenant, self._tenants.charge(tenant, num_tokens))
            self._observer.on_served(tenant, num_tokens)

    def queue_changed(self) -> None:
        self._observer.on_queue_depth(len(self._queue))
        self._observer.on_queue_bands(self._queue.depth_by_band())
