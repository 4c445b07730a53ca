"""What changed since the last save, and saving it: persistence kept out of the Scheduler.

The Scheduler marks what it changes (`created`, `touched`, `grown`, ...) and calls
`save` before it answers; `save` hands everything marked to the store as one
`StateChanges`, which the store applies all or nothing. After a failed save nothing is
marked saved, so the next save carries it again, and no answer rests on unsaved state.
"""

from __future__ import annotations

from service.core.persist.store import StateChanges, StateStore, StoredWorker, TokenAppend
from service.core.tables.sequences import Sequence
from service.core.types import SubmitParams


class ChangeSet:
    """Changes made since the last successful save, and the store they go to (if any)."""

    def __init__(self, store: StateStore | None) -> None:
        self._store = store
        self._created: dict[int, SubmitParams] = {}
        self._touched: dict[int, Sequence] = {}  # progress changed
        self._grown: dict[int, Sequence] = {}  # output tokens added
        self._forgotten: list[int] = []
        self._workers: dict[str, StoredWorker | None] = {}  # None: left
        self._tenants: dict[str, float] = {}

    def created(self, seq: Sequence) -> None:
        self._created[seq.seq_id] = seq.params
        self._touched[seq.seq_id] = seq

    def uncreated(self, seq: Sequence) -> None:
        """Forget the creation of a sequence that was never saved (its Submit failed)."""
        self._created.pop(seq.seq_id, None)
        self._touched.pop(seq.seq_id, None)

    def discard(self, seq_ids: frozenset[int]) -> None:
        """Drop unsaved changes of sequences this core gave up (another replica owns them)."""
        for marks in (self._created, self._touched, self._grown):
            for seq_id in seq_ids & marks.keys():
                del marks[seq_id]

    def marked_seq_ids(self) -> frozenset[int]:
        """The sequences with unsaved changes."""
        return frozenset(self._created.keys() | self._touched.keys() | self._grown.keys())

    def unsaved_creations(self, seq_ids: frozenset[int]) -> frozenset[int]:
        """Those of `seq_ids` never saved: their creation is among the unsaved changes."""
        return seq_ids & self._created.keys()

    def drop_all(self) -> None:
        """Drop every unsaved change (one the store refuses whatever sequences go)."""
        self._clear()

    def touched(self, seq: Sequence) -> None:
        """Its progress (state, worker, cursor, ...) changed."""
        self._touched[seq.seq_id] = seq

    def grown(self, seq: Sequence) -> None:
        """Tokens were added to its output."""
        self._grown[seq.seq_id] = seq

    def grown_all(self, seqs: dict[int, Sequence]) -> None:
        """Tokens were added to the outputs of `seqs` (by seq_id)."""
        self._grown.update(seqs)

    def forgotten(self, seq_ids: list[int]) -> None:
        self._forgotten.extend(seq_ids)

    def worker_changed(self, worker: StoredWorker) -> None:
        """A worker joined, or its stored part (registration, operator drain) changed."""
        self._workers[worker.registration.worker_id] = worker

    def worker_left(self, worker_id: str) -> None:
        self._workers[worker_id] = None

    def tenant_served(self, tenant: str, served: float) -> None:
        self._tenants[tenant] = served

    def save(self, next_seq_id: int, last_incarnation: int, sync: bool = False) -> None:
        """Hand everything changed to the store as one change (StoreError: kept for the
        next save). `next_seq_id` is saved when the change hands out new ids,
        `last_incarnation` when workers changed."""
        if not (
            self._touched
            or self._grown
            or self._created
            or self._forgotten
            or self._workers
            or self._tenants
        ):
            return
        if self._store is None:
            self._clear()
            return
        grown = [
            seq for seq in self._grown.values() if len(seq.output_token_ids) > seq.num_saved_tokens
        ]
        self._store.save(
            StateChanges(
                created=tuple(self._created.items()),
                progress=tuple(seq.progress() for seq in self._touched.values()),
                tokens=tuple(
                    TokenAppend(
                        seq.seq_id,
                        seq.num_saved_tokens,
                        tuple(seq.output_token_ids[seq.num_saved_tokens :]),
                    )
                    for seq in grown
                ),
                # Every finish touches its sequence, and nothing touches it after.
                final_outputs=tuple(
                    (seq.seq_id, tuple(seq.output_token_ids))
                    for seq in self._touched.values()
                    if seq.is_finished
                ),
                forgotten=tuple(self._forgotten),
                workers_changed=tuple(w for w in self._workers.values() if w is not None),
                workers_left=tuple(w for w, stored in self._workers.items() if stored is None),
                next_seq_id=next_seq_id if self._created else None,
                last_incarnation=last_incarnation if self._workers else None,
                tenant_service=tuple(self._tenants.items()),
                sync=sync,
            )
        )
        for seq in grown:
            seq.num_saved_tokens = len(seq.output_token_ids)
        self._clear()

    def _clear(self) -> None:
        self._touched.clear()
        self._grown.clear()
        self._created.clear()
        self._forgotten.clear()
        self._workers.clear()
        self._tenants.clear()
