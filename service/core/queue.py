"""The admission queue: mechanism only, it knows no limits and reads no config."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator


class AdmissionQueue:
    """Sequence ids in admission order, with O(1) push at either end and O(1) removal."""

    def __init__(self) -> None:
        # Keys in order are the queue; values are unused. OrderedDict gives O(1)
        # move-to-front and O(1) removal from the middle (cancel).
        self._ids: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._ids

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def push_back(self, seq_id: int) -> None:
        """Append at the tail; the id must not be queued already."""
        assert seq_id not in self._ids, f"seq_id {seq_id} queued twice"
        self._ids[seq_id] = None

    def push_front(self, seq_ids: Iterable[int]) -> None:
        """Put ids at the head, keeping their given order ahead of everything queued."""
        for seq_id in reversed(list(seq_ids)):
            assert seq_id not in self._ids, f"seq_id {seq_id} queued twice"
            self._ids[seq_id] = None
            self._ids.move_to_end(seq_id, last=False)

    def remove(self, seq_id: int) -> bool:
        """Drop an id wherever it is; False if it was not queued."""
        return self._ids.pop(seq_id, 0) is None

    def position(self, seq_id: int) -> int:
        """Ids ahead of `seq_id` (O(n); for status queries, not the hot path)."""
        for index, queued in enumerate(self._ids):
            if queued == seq_id:
                return index
        raise KeyError(seq_id)
