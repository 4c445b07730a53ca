"""Where the scheduler's state outlives the process: the interface, and an in-memory store.

The core hands a store one `StateChanges` per state-changing call and does not answer
the call before `save` returns. A store makes each `StateChanges` atomic: all of it
survives a crash, or none of it does. `load` gives back what was saved, for a restart.

SQLite is the embedded store (service/state/sqlite.py). PostgreSQL holds the state of
several replicas (service/state/postgres.py): each replica's core owns some sequences,
and a save that touches one another replica took over is refused whole with `Disowned`;
the core then forgets those sequences (`Lifecycle.forget`) and saves the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from service.core.errors import SchedulerError
from service.core.types import FinishReason, SequenceState, SubmitParams, WorkerRegistration


class StoreError(SchedulerError):
    """The store could not save; the call that needed it fails (UNAVAILABLE)."""


class Refused(StoreError):
    """The store refused the change for its data, not for being unreachable: saving the
    same data again would fail the same way. `seq_ids`: the sequences whose data it
    refused (empty: it cannot tell which). Nothing of the save was applied."""

    def __init__(self, reason: str, seq_ids: frozenset[int] = frozenset()) -> None:
        super().__init__(reason)
        self.seq_ids = seq_ids


class Disowned(StoreError):
    """A shared store refused a save: these sequences belong to another replica now
    (this one's lease ran out, or their worker moved). Nothing of the save was applied."""

    def __init__(self, seq_ids: frozenset[int]) -> None:
        super().__init__(f"{len(seq_ids)} sequences belong to another replica now")
        self.seq_ids = seq_ids


@dataclass(frozen=True)
class SequenceProgress:
    """The mutable part of a sequence: everything but its params and tokens."""

    seq_id: int
    state: SequenceState
    worker_id: str | None
    queue_key: int | None  # ascending keys are queue order; None when not queued
    cursor: int
    prefilled_tokens: int
    num_generated: int
    num_generated_at_admission: int
    finish_reason: FinishReason | None
    finish_order: int = 0  # 1, 2, ... in the order sequences finished; 0 until then
    submitted_at: float = 0.0  # wall-clock seconds of the first submission (aging)
    admission_order: int = 0  # 1, 2, ... in the order of admissions to workers
    error_message: str = ""  # why it failed, for FAILED


@dataclass(frozen=True)
class TokenAppend:
    """Tokens a sequence generated, from index `start` of its output on."""

    seq_id: int
    start: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class StoredWorker:
    """A registered worker as saved: its registration, and whether an operator drained it."""

    registration: WorkerRegistration
    drain_requested: bool = False
    incarnation: int = 0


@dataclass(frozen=True)
class StateChanges:
    """What one call changed. `sync`: the caller acknowledges it to a client, so it must
    survive a power loss too, not only a crash of the process."""

    created: tuple[tuple[int, SubmitParams], ...] = ()
    progress: tuple[SequenceProgress, ...] = ()
    tokens: tuple[TokenAppend, ...] = ()
    # The whole output of each sequence that finished in this change (a store may keep
    # finished outputs in one piece and drop the appends that built them).
    final_outputs: tuple[tuple[int, tuple[int, ...]], ...] = ()
    forgotten: tuple[int, ...] = ()  # finished sequences dropped from memory and store
    # Disjoint: a worker that left and joined again within one call is only in workers_changed.
    workers_changed: tuple[StoredWorker, ...] = ()  # joined, or its stored part changed
    workers_left: tuple[str, ...] = ()
    next_seq_id: int | None = None  # set when the change hands out new ids
    # (tenant, weighted tokens served so far) of the tenants served in this change (fair).
    tenant_service: tuple[tuple[str, float], ...] = ()
    last_incarnation: int | None = None  # set when workers changed: the latest handed out
    sync: bool = False


@dataclass
class StoredSequence:
    seq_id: int
    params: SubmitParams
    progress: SequenceProgress
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class StoredState:
    """Everything saved so far, as `load` gives it back."""

    sequences: list[StoredSequence] = field(default_factory=list)  # ascending seq_id
    workers: list[StoredWorker] = field(default_factory=list)
    next_seq_id: int = 1
    tenant_service: dict[str, float] = field(default_factory=dict)
    last_incarnation: int = 0  # never hand out this number or a lower one again


class StateStore(Protocol):
    def load(self) -> StoredState: ...

    def save(self, changes: StateChanges) -> None:
        """Apply `changes` atomically, or raise StoreError and apply none of them."""

    def close(self) -> None: ...


class MemoryStore:
    """Keeps saved state in this process: for tests of recovery, and a reference for the
    semantics every store must have (tests/unit/test_durable_state.py runs both)."""

    def __init__(self) -> None:
        self._params: dict[int, SubmitParams] = {}
        self._progress: dict[int, SequenceProgress] = {}
        self._tokens: dict[int, list[int]] = {}
        self._workers: dict[str, StoredWorker] = {}
        self._tenant_service: dict[str, float] = {}
        self._next_seq_id = 1
        self._last_incarnation = 0
        self.saves = 0
        self.fail_next_save: StoreError | None = None

    def load(self) -> StoredState:
        return StoredState(
            sequences=[
                StoredSequence(
                    seq_id,
                    self._params[seq_id],
                    self._progress[seq_id],
                    list(self._tokens.get(seq_id, ())),
                )
                for seq_id in sorted(self._params)
            ],
            workers=list(self._workers.values()),
            next_seq_id=self._next_seq_id,
            tenant_service=dict(self._tenant_service),
            last_incarnation=self._last_incarnation,
        )

    def save(self, changes: StateChanges) -> None:
        if self.fail_next_save is not None:
            error, self.fail_next_save = self.fail_next_save, None
            raise error
        for append in changes.tokens:  # check first: a refused save changes nothing
            known = len(self._tokens.get(append.seq_id, ()))
            if append.start != known:
                raise StoreError(
                    f"seq_id {append.seq_id}: tokens from {append.start} saved after {known} tokens"
                )
        for seq_id, params in changes.created:
            self._params[seq_id] = params
        for progress in changes.progress:
            self._progress[progress.seq_id] = progress
        for append in changes.tokens:
            self._tokens.setdefault(append.seq_id, []).extend(append.token_ids)
        for seq_id, output in changes.final_outputs:
            if tuple(self._tokens.get(seq_id, ())) != output:
                raise StoreError(f"seq_id {seq_id}: final output differs from its appends")
        for worker in changes.workers_changed:
            self._workers[worker.registration.worker_id] = worker
        for worker_id in changes.workers_left:
            self._workers.pop(worker_id, None)
        for seq_id in changes.forgotten:
            self._params.pop(seq_id, None)
            self._progress.pop(seq_id, None)
            self._tokens.pop(seq_id, None)
        if changes.next_seq_id is not None:
            self._next_seq_id = changes.next_seq_id
        self._tenant_service.update(changes.tenant_service)
        if changes.last_incarnation is not None:
            self._last_incarnation = changes.last_incarnation
        self.saves += 1

    def close(self) -> None:
        pass
