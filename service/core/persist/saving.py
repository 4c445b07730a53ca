"""The save scope of each state-changing call: what an earlier failed save left is saved
first, and what the call changed is saved before it returns (undone if that fails)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from service.core.persist.store import Disowned, StoreError
from service.core.tables.lifecycle import Lifecycle
from service.core.tables.tables import Tables


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
        now (forgotten here, the rest saved)."""
        disowned: frozenset[int] = frozenset()
        while True:
            try:
                self._changes.save(self._sequences.next_seq_id, self._last_incarnation(), sync)
                return disowned
            except Disowned as err:
                if err.seq_ids <= disowned:
                    raise  # the store insists on ids already given up: a store bug
                disowned |= err.seq_ids
                self._lifecycle.forget(err.seq_ids)


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
