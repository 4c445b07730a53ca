"""Changes to a set of resume points, kept until someone takes them (torch-free).

The engines record each change as it happens; the worker loop keeps what it has not yet
delivered to the scheduler. Either way a change and its undoing before the next `take`
cancel out, so a delta lists each resume point at most once.
"""

from __future__ import annotations

from .api import CacheDelta


class ResumePointLog:
    """Resume points added and removed since the last `take` (or since a reset)."""

    def __init__(self) -> None:
        self._added: dict[int, None] = {}  # ordered sets
        self._removed: dict[int, None] = {}
        self._reset = False

    def __bool__(self) -> bool:
        return bool(self._added or self._removed or self._reset)

    def add(self, block_hash: int) -> None:
        if block_hash in self._removed:  # gone and back since the last take: no change
            del self._removed[block_hash]
        else:
            self._added[block_hash] = None

    def remove(self, block_hash: int) -> None:
        if block_hash in self._added:  # new and gone since the last take: no change
            del self._added[block_hash]
        elif not self._reset:  # after a reset, what is not in `added` is unknown already
            self._removed[block_hash] = None

    def apply(self, delta: CacheDelta) -> None:
        """Fold a later delta in (a reset replaces everything kept)."""
        if delta.reset:
            self.reset(delta.added)
            return
        for block_hash in delta.removed:
            self.remove(block_hash)
        for block_hash in delta.added:
            self.add(block_hash)

    def reset(self, current: tuple[int, ...] | list[int]) -> None:
        """Start over from a full list of the current resume points."""
        self._added = dict.fromkeys(current)
        self._removed.clear()
        self._reset = True

    def take(self) -> CacheDelta:
        delta = CacheDelta(tuple(self._added), tuple(self._removed), self._reset)
        self._added, self._removed, self._reset = {}, {}, False
        return delta

    def peek(self) -> CacheDelta:
        return CacheDelta(tuple(self._added), tuple(self._removed), self._reset)
