"""The save scope of each state-changing call: what an earlier failed save left is saved
first, and what the call changed is saved before it returns (undone if that fails)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from service.core.persist.store import Disowned, Refused, StoreError
from service.core.tables.lifecycle import Lifecycle
from service.core.tables.tables import Tables
from service.core.types import FinishReason, SequenceState


@dataclass
class Saved:
    """What one save scope saw: the ids its save gave up (another replica owns them
    now), and what to undo if its save fails."""

    disowned: frozenset[int] = frozenset()
    undo: list[Callable[[], None]] = field(default_factory=list)


class Saver:
    """Saves the tables' changes, giving up the ids a shared store says are another
    replica's now."""

    def __init__(
        self, tables: Tables, lifecycle: Lifecycle, last_incarnation: Callable[[], int]
    ) -> None:
        self._changes = tables.changes
        self._sequences = tables.sequences
        self._queue = tables.queue
        self._ledger = tables.ledger
        self._observer = tables.observer
        self._lifecycle = lifecycle
        self._last_incarnation = last_incarnation

    def scope(self, sync: bool = False) -> SaveScope:
        """The save scope of one state-changing call (`with saver.scope() as saved:`).
        Before the body: what an earlier failed save left is saved (StoreError while the
        store still fails). After it, also when it raised: what it changed is saved; if
        that save fails, the scope's undo steps run and StoreError propagates. `sync`:
        the save must survive a power loss (acknowledged to a client)."""
        return SaveScope(self.save, sync)

    def save(self, sync: bool) -> frozenset[int]:
        """Save what changed; returns the ids a shared store said are another replica's
        now (forgotten here, the rest saved). A change the store refuses for its data
        (`Refused`) is not kept to be retried on every later save, where it would fail
        every call: the sequences it names are failed (`_fail_refused`) and the rest
        saved; one it refuses whatever sequences go is dropped whole."""
        disowned: frozenset[int] = frozenset()
        refused: frozenset[int] = frozenset()
        while True:
            try:
                self._changes.save(self._sequences.next_seq_id, self._last_incarnation(), sync)
                return disowned
            except Disowned as err:
                if err.seq_ids <= disowned:
                    raise  # the store insists on ids already given up: a store bug
                disowned |= err.seq_ids
                self._lifecycle.forget(err.seq_ids)
            except Refused as err:
                marked = self._changes.marked_seq_ids()
                seq_ids = (err.seq_ids & marked) or marked
                if not seq_ids or seq_ids <= refused:
                    # Not the sequences' data (or failing them did not help): drop it all.
                    self._changes.drop_all()
                    self._observer.on_change_refused(0, str(err))
                    continue
                refused |= seq_ids
                self._fail_refused(seq_ids, str(err))
                self._observer.on_change_refused(len(seq_ids), str(err))

    def _fail_refused(self, seq_ids: frozenset[int], reason: str) -> None:
        """Fail the sequences whose data the store refused, with an error that says so;
        their unsaved changes are dropped. One never saved stays failed in memory only
        (its creation was the refused data); the failure of one saved before is saved
        (it holds only what the store took before, and this message)."""
        never_saved = self._changes.unsaved_creations(seq_ids)
        self._changes.discard(seq_ids)
        message = (
            f"the state store refused to save this sequence ({reason}); it was failed "
            "rather than retried on every later save: submit it again with values the "
            "store can hold"
        )
        for seq_id in seq_ids:
            seq = self._sequences.get(seq_id)
            if seq is None:
                continue
            if not seq.is_finished:
                if seq.state is SequenceState.QUEUED:
                    self._queue.remove(seq_id)
                    self._lifecycle.queue_changed()
                else:
                    worker = self._ledger.find(seq.worker_id or "")
                    if worker is not None:
                        worker.assigned.pop(seq_id, None)
                seq.error_message = message
                self._lifecycle.finish(seq, FinishReason.FAILED)
            elif seq.finish_reason is FinishReason.FAILED:
                seq.error_message = message  # the worker's message may be what was refused
                self._changes.touched(seq)
            else:
                self._changes.touched(seq)
        self._changes.discard(never_saved)


class SaveScope:
    """Saver.scope as a plain context manager (a generator's costs more per call, and
    select_batch enters one every call)."""

    __slots__ = ("_save", "_sync", "_saved")

    def __init__(self, save: Callable[[bool], frozenset[int]], sync: bool) -> None:
        self._save = save
        self._sync = sync

    def __enter__(self) -> Saved:
        self._save(self._sync)
        self._saved = Saved()
        return self._saved

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self._save(self._sync)
            return False  # the body's exception propagates
        try:
            self._saved.disowned = self._save(self._sync)
        except StoreError:
            for undo in self._saved.undo:
                undo()
            raise
        return False
