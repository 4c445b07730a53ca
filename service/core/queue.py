"""The admission queue: mechanism only, it knows no limits and reads no config."""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator
from typing import NamedTuple


class _Entry(NamedTuple):
    # Sorting by key gives the queue order back, so the order survives a restart
    # without rewriting every position: the tail counts up, the head counts down.
    key: int
    tenant: str


class AdmissionQueue:
    """Sequence ids in admission order, with O(1) push at either end and O(1) removal.

    Each id carries an order key (for storage) and its tenant (for per-tenant counts).
    """

    def __init__(self) -> None:
        # OrderedDict gives O(1) move-to-front and O(1) removal from the middle (cancel).
        self._ids: OrderedDict[int, _Entry] = OrderedDict()
        self._per_tenant: Counter[str] = Counter()
        self._head_key = 0  # key of the last id pushed to the head
        self._tail_key = 0  # key of the last id pushed to the tail

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._ids

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def count(self, tenant: str) -> int:
        """How many queued ids belong to `tenant`."""
        return self._per_tenant[tenant]

    def key(self, seq_id: int) -> int:
        """The id's order key: ascending keys are queue order."""
        return self._ids[seq_id].key

    def push_back(self, seq_id: int, tenant: str = "") -> None:
        """Append at the tail; the id must not be queued already."""
        self._tail_key += 1
        self._insert(seq_id, _Entry(self._tail_key, tenant))

    def push_front(self, items: Iterable[tuple[int, str]]) -> None:
        """Put (seq_id, tenant) items at the head, in their given order, ahead of all."""
        for seq_id, tenant in reversed(list(items)):
            self._head_key -= 1
            self._insert(seq_id, _Entry(self._head_key, tenant))
            self._ids.move_to_end(seq_id, last=False)

    def restore(self, items: Iterable[tuple[int, str, int]]) -> None:
        """Rebuild from stored (seq_id, tenant, key) items; the queue must be empty."""
        assert not self._ids, "restore into a non-empty queue"
        for seq_id, tenant, key in sorted(items, key=lambda item: item[2]):
            self._insert(seq_id, _Entry(key, tenant))
        if self._ids:
            first, last = next(iter(self._ids.values())), next(reversed(self._ids.values()))
            self._head_key = min(0, first.key)
            self._tail_key = max(0, last.key)

    def remove(self, seq_id: int) -> bool:
        """Drop an id wherever it is; False if it was not queued."""
        entry = self._ids.pop(seq_id, None)
        if entry is None:
            return False
        self._per_tenant[entry.tenant] -= 1
        if not self._per_tenant[entry.tenant]:
            del self._per_tenant[entry.tenant]
        return True

    def position(self, seq_id: int) -> int:
        """Ids ahead of `seq_id` (O(n); for status queries, not the hot path)."""
        for index, queued in enumerate(self._ids):
            if queued == seq_id:
                return index
        raise KeyError(seq_id)

    def _insert(self, seq_id: int, entry: _Entry) -> None:
        assert seq_id not in self._ids, f"seq_id {seq_id} queued twice"
        self._ids[seq_id] = entry
        self._per_tenant[entry.tenant] += 1
