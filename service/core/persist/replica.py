"""The core of one replica over a shared store (docs/replicas.md): a Scheduler that owns
only some of the sequences, takes more from the shared queue (`adopt`), gives some up
(`disown`), and says how many queued sequences it should hold (prefetch).
"""

from __future__ import annotations

from collections.abc import Iterable

from service.core.persist.store import StoredSequence
from service.core.scheduler import Scheduler
from service.core.types import Caller, SequenceState, SubmitParams


class ReplicaScheduler(Scheduler):
    """A Scheduler plus what a replica's servicer (service/replicas/) asks of its core."""

    def num_busy_workers(self) -> int:
        """Workers that hold sequences now: those whose SelectBatch comes every step (an
        idle worker waits in a long poll and saves nothing until it gets work)."""
        return self._ledger.num_busy()

    def adopt(self, stored: Iterable[StoredSequence], worker_id: str = "") -> list[int]:
        """Take over sequences from a shared store: queued ones join the local queue at
        their place (queue_key, arrival); with `worker_id`, assigned ones become that
        registered worker's, and its next report reconciles them as after a restart.
        Ids already known are skipped; returns those adopted."""
        with self._saving():
            worker = self._ledger.find(worker_id) if worker_id else None
            return self._recovery.adopt(stored, worker)

    def disown(self, seq_ids: Iterable[int]) -> None:
        """Forget sequences another replica owns now: off the local queue and workers, out
        of the table, unsaved changes dropped. Nothing is finished or requeued; a worker
        that still reports one is told to evict it."""
        self._lifecycle.forget(seq_ids)

    def shed_if_late(
        self, params: SubmitParams, shared_tokens_ahead: int, num_replicas: int
    ) -> None:
        """DeadlineUnreachable for a sheddable request (Scheduler.is_sheddable) that this
        replica's workers could not start before its deadline, as the single scheduler
        sheds: behind its own queue's prefill tokens of as urgent requests plus its share
        of the shared queue's unclaimed ones (`shared_tokens_ahead` over `num_replicas`,
        each replica claiming its part). A replica with no worker that takes work sheds
        nothing: the others' workers may start the request in time, and it cannot tell."""
        if not any(not (w.draining or w.drain_requested) for w in self._ledger):
            return
        self._shed_if_late(params, shared_tokens_ahead // max(1, num_replicas))

    def holds(self, seq_id: int) -> bool:
        """Whether this core holds `seq_id` (owned here; finished ones until forgotten)."""
        return self._sequences.get(seq_id) is not None

    def may_see(self, seq_id: int, caller: Caller) -> bool:
        """Whether this core holds `seq_id` and `caller` may see it."""
        seq = self._sequences.get(seq_id)
        return seq is not None and caller.may_see(seq.params.principal)

    def owned_seq_ids(self) -> set[int]:
        """Every unfinished sequence this core holds (queued or assigned)."""
        return {seq.seq_id for seq in self._sequences if not seq.is_finished}

    def prefetch_wanted(self, depth: int, num_freeing: int = 0, resuming: str = "") -> int:
        """How many more queued sequences this core should hold (`prefetch_target`, with
        `num_freeing` places a report is about to free) less what its queue holds."""
        return max(0, self.prefetch_target(depth, num_freeing, resuming) - len(self._queue))

    def prefetch_target(self, depth: int, num_freeing: int = 0, resuming: str = "") -> int:
        """Queued sequences worth holding: the workers' free places (drained ones have
        none) plus `depth` ahead; nothing without a worker that takes work. `resuming`:
        a worker whose report, about to be read, ends its own draining (its places
        count)."""
        workers = [
            w
            for w in self._ledger
            if not w.drain_requested and (not w.draining or w.worker_id == resuming)
        ]
        if not workers:
            return 0
        free = sum(max(0, w.settings.max_batch_size - len(w.assigned)) for w in workers)
        return free + num_freeing + depth

    def servable_adapters(self) -> frozenset[str]:
        """The adapters of this core's workers that admit now: a claim takes a sequence
        with an adapter only when one of them has it."""
        return self._reads.servable_adapters(admitting_only=True)

    def unservable_queued(self) -> list[int]:
        """Queued ids whose adapter none of this core's workers that admit now has (to
        hand back to the shared queue, for a replica whose worker has it)."""
        servable = self.servable_adapters()
        if not self._reads.num_unservable(servable):
            return []
        return [
            seq.seq_id
            for seq in self._sequences
            if seq.state is SequenceState.QUEUED
            and seq.adapter_id
            and seq.adapter_id not in servable
        ]

    def queued_tail(self, count: int) -> list[int]:
        """The last `count` queued ids in the queue order (those to hand back first);
        what is unsaved is saved first, so the store holds them as they are."""
        with self._saving():
            if count <= 0:
                return []
            order = list(self._queue.candidates(self._clock(), self._served))
            return order[-count:]

    def num_queued(self) -> int:
        return len(self._queue)

    def hand_out_incarnations_from(self, incarnation: int) -> None:
        """The next registration gets `incarnation` or more (replicas draw it from a
        database sequence, so numbers never repeat across replicas)."""
        self._workers.last_incarnation = max(self._workers.last_incarnation, incarnation - 1)
