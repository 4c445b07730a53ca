"""The sequences a replica knows it owns, shared by the commit thread and the threads
that claim, adopt and release (service/state/postgres.py).

A commit that touches only these, under the fence it last saw, needs no per-row check.
The slow path re-reads the set from the database; a claim that commits while that read
is in flight must not be lost when the read replaces the set (nor a release undone):
`refreshing()` journals every change made from just before the read until the new set
is in place, and replays it over what was read.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager


class OwnedSet:
    """A thread-safe set of seq_ids with a refresh that keeps concurrent changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: set[int] = set()
        # Changes made since a refresh began: (True: added, False: removed, ids).
        self._journal: list[tuple[bool, frozenset[int]]] | None = None

    def add(self, seq_ids: Iterable[int]) -> None:
        ids = frozenset(seq_ids)
        with self._lock:
            self._ids |= ids
            if self._journal is not None:
                self._journal.append((True, ids))

    def discard(self, seq_ids: Iterable[int]) -> None:
        ids = frozenset(seq_ids)
        with self._lock:
            self._ids -= ids
            if self._journal is not None:
                self._journal.append((False, ids))

    def covers(self, seq_ids: set[int]) -> bool:
        with self._lock:
            return seq_ids <= self._ids

    def __contains__(self, seq_id: int) -> bool:
        with self._lock:
            return seq_id in self._ids

    @contextmanager
    def refreshing(self) -> Iterator[list[set[int]]]:
        """`with owned.refreshing() as read: ...; read.append(ids)`: enter before the
        database read begins; when the block ends without an error, the set becomes the
        ids appended (if any) with every add and discard made since entering replayed over
        them. One refresh at a time (the commit thread's)."""
        read: list[set[int]] = []
        with self._lock:
            self._journal = []
        try:
            yield read
        except BaseException:
            with self._lock:
                self._journal = None
            raise
        with self._lock:
            if read:
                ids = set(read[0])
                for added, changed in self._journal or ():
                    if added:
                        ids |= changed
                    else:
                        ids -= changed
                self._ids = ids
            self._journal = None
