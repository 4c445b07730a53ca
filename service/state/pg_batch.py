"""The saves of one replica not yet committed, merged into one batch (group commit on
PostgreSQL: service/state/pg_commit.py).

Each `StateChanges` the core saves is absorbed in order; a batch is written by one
transaction. Merging keeps what each change means: the latest progress of a sequence
wins, token appends stay separate rows in order (a sequence's appends are contiguous),
workers end as their last change left them, tenants' counters are the latest. A batch
whose commit failed is retried alone, under its commit number, before what was saved
since (service/state/postgres.py `commit_pending`), so nothing is lost, reordered or
applied twice; `then` merges two batches in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.core.persist.store import SequenceProgress, StateChanges, StoredWorker, TokenAppend
from service.core.types import SequenceState


@dataclass
class SaveBatch:
    """Changes of one or more saves, in the order they were made."""

    progress: dict[int, SequenceProgress] = field(default_factory=dict)
    tokens: list[TokenAppend] = field(default_factory=list)
    # The whole output of each sequence that finished (its text's home key).
    final_outputs: dict[int, tuple[int, ...]] = field(default_factory=dict)
    forgotten: list[int] = field(default_factory=list)
    workers: dict[str, StoredWorker | None] = field(default_factory=dict)  # None: left
    tenant_service: dict[str, float] = field(default_factory=dict)
    sync: bool = False  # some save in it is acknowledged to a client
    num_saves: int = 0
    # Its number among this replica's commits, drawn at its first attempt and kept for
    # retries (replicas.last_commit: a retry of a commit that did commit applies nothing).
    commit_no: int = 0

    def absorb(self, changes: StateChanges) -> None:
        for progress in changes.progress:
            self.progress[progress.seq_id] = progress
        self.tokens.extend(changes.tokens)
        self.final_outputs.update(changes.final_outputs)
        self.forgotten.extend(changes.forgotten)
        for worker in changes.workers_changed:
            self.workers[worker.registration.worker_id] = worker
        for worker_id in changes.workers_left:
            self.workers[worker_id] = None
        self.tenant_service.update(changes.tenant_service)
        self.sync = self.sync or changes.sync
        self.num_saves += 1

    def then(self, later: SaveBatch) -> SaveBatch:
        """This batch followed by `later` (this one's commit failed; `later` was saved
        meanwhile)."""
        merged = SaveBatch(
            progress={**self.progress, **later.progress},
            tokens=[*self.tokens, *later.tokens],
            final_outputs={**self.final_outputs, **later.final_outputs},
            forgotten=[*self.forgotten, *later.forgotten],
            workers={**self.workers, **later.workers},
            tenant_service={**self.tenant_service, **later.tenant_service},
            sync=self.sync or later.sync,
            num_saves=self.num_saves + later.num_saves,
        )
        for worker_id in later.workers:  # keep the later change's place in the order
            merged.workers[worker_id] = merged.workers.pop(worker_id)
        return merged

    def is_empty(self) -> bool:
        return not (
            self.progress or self.tokens or self.forgotten or self.workers or self.tenant_service
        )

    def touched(self) -> set[int]:
        """The sequences whose rows this batch writes (their owner must be this replica)."""
        return {*self.progress, *(t.seq_id for t in self.tokens)}

    def finished(self) -> set[int]:
        return {p.seq_id for p in self.progress.values() if p.state is SequenceState.FINISHED}

    def without(self, seq_ids: set[int] | frozenset[int]) -> SaveBatch:
        """This batch less every change of `seq_ids` (they belong to another replica)."""
        return SaveBatch(
            progress={k: v for k, v in self.progress.items() if k not in seq_ids},
            tokens=[t for t in self.tokens if t.seq_id not in seq_ids],
            final_outputs={k: v for k, v in self.final_outputs.items() if k not in seq_ids},
            forgotten=[s for s in self.forgotten if s not in seq_ids],
            workers=dict(self.workers),
            tenant_service=dict(self.tenant_service),
            sync=self.sync,
            num_saves=self.num_saves,
            commit_no=self.commit_no,
        )
