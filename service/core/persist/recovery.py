"""Sequences that come from a store: all of them after a restart (`restore`), or those a
replica takes over from a shared store (`adopt`). Both rebuild records as saved; what
was assigned to a worker the core does not know goes back to the head of the queue.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from service.core.observer import RequeueReason
from service.core.persist.store import StoredSequence, StoredState
from service.core.tables.ledger import WorkerRecord
from service.core.tables.lifecycle import Lifecycle
from service.core.tables.sequences import Sequence
from service.core.tables.tables import Tables
from service.core.types import FinishReason, SequenceState


class Recovery:
    """Rebuilds sequences from stored ones into the core's tables."""

    def __init__(
        self, tables: Tables, lifecycle: Lifecycle, wall_clock: Callable[[], float]
    ) -> None:
        self._sequences = tables.sequences
        self._queue = tables.queue
        self._ledger = tables.ledger
        self._tenants = tables.tenants
        self._lifecycle = lifecycle
        self._clock = tables.clock
        self._wall_clock = wall_clock

    def restore(self, state: StoredState) -> None:
        """Rebuild from a whole store, its workers already registered: the queue in its
        order, each worker with what it held."""
        self._sequences.reserve_ids_below(state.next_seq_id)
        if self._tenants is not None:
            self._tenants.restore(state.tenant_service)
        now, wall_now = self._clock(), self._wall_clock()
        keyed, unkeyed, orphans = [], [], []
        for stored in state.sequences:
            seq = self._restore(stored, now, wall_now)
            if seq.state is SequenceState.QUEUED:
                # Saved without its place (an older schema): behind every placed one.
                (keyed if stored.progress.queue_key is not None else unkeyed).append(seq)
            elif not seq.is_finished:
                worker = self._ledger.find(seq.worker_id or "")
                if worker is None:
                    orphans.append(seq.seq_id)
                else:
                    worker.assigned[seq.seq_id] = seq
        self._sequences.restore_finished_order()
        self._queue.restore(sorted(keyed, key=lambda s: (s.queue_key, s.seq_id)))
        for seq in unkeyed:  # ascending seq_id
            self._queue.push_back(seq)
        self._lifecycle.back_to_queue(orphans, "", RequeueReason.LOST)
        self._lifecycle.queue_changed()

    def adopt(self, stored: Iterable[StoredSequence], worker: WorkerRecord | None) -> list[int]:
        """Add sequences the tables do not hold (ids already known are skipped): queued
        ones at their place (queue_key, arrival), those assigned to `worker` as its own;
        returns the ids adopted."""
        now, wall_now = self._clock(), self._wall_clock()
        queued, orphans, adopted = [], [], []
        for item in stored:
            if self._sequences.get(item.seq_id) is not None:
                continue
            seq = self._restore(item, now, wall_now)
            adopted.append(seq.seq_id)
            if seq.is_finished:
                continue
            if seq.state is SequenceState.QUEUED:
                if len(seq.output_token_ids) >= seq.params.max_new_tokens:
                    self._lifecycle.finish(seq, FinishReason.MAX_LENGTH)  # nothing to resume
                else:
                    queued.append(seq)
            elif worker is not None and seq.worker_id == worker.worker_id:
                worker.assigned[seq.seq_id] = seq
            else:
                orphans.append(seq.seq_id)
        self._queue.adopt(queued)
        self._lifecycle.back_to_queue(orphans, "", RequeueReason.LOST)
        self._lifecycle.queue_changed()
        return adopted

    def _restore(self, stored: StoredSequence, now: float, wall_now: float) -> Sequence:
        seq = self._sequences.restore(stored, now, wall_now)
        if not seq.is_finished and self._tenants is not None:
            self._tenants.restore_active(seq.tenant)
        return seq
