"""GDN state snapshots of the prefix cache: a pool of its own, by block hash, LRU (torch-free).

A snapshot of block hash h_i is every linear-attention layer's state (conv and
recurrent) after the last token of block i, copied out of a sequence's GDN slot right
after a forward that ended exactly there. Resuming copies it into a new sequence's slot.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class SlotStates(Protocol):
    """Where GDN states live: engine.state_pool.GdnStatePool, or a stand-in with no tensors."""

    def empty_like(self, num_slots: int) -> SlotStates: ...

    def copy_slot(self, source: SlotStates, source_slot: int, slot: int) -> None: ...


class SnapshotPool:
    """`num_slots` snapshots in slots shaped as `states`' slots; least recently used first out."""

    def __init__(self, states: SlotStates, num_slots: int) -> None:
        self.num_slots = num_slots
        self._states = states
        self._storage = states.empty_like(num_slots) if num_slots else None
        self._slots: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, LRU first
        self._free_slots = list(range(num_slots - 1, -1, -1))

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def hashes(self) -> list[int]:
        return list(self._slots)

    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def take(self, block_hash: int, slot: int) -> int | None:
        """Snapshot GDN slot `slot` under `block_hash` (or refresh its recency if it has
        one); the hash whose snapshot made room, or None."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return None
        if self.num_slots == 0:
            return None
        evicted = None
        if not self._free_slots:
            evicted, freed = self._slots.popitem(last=False)
            self._free_slots.append(freed)
        snapshot_slot = self._free_slots.pop()
        self._storage.copy_slot(self._states, slot, snapshot_slot)
        self._slots[block_hash] = snapshot_slot
        return evicted

    def restore(self, block_hash: int, slot: int) -> None:
        """Copy the snapshot of `block_hash` into GDN slot `slot` (it must exist)."""
        snapshot_slot = self._slots[block_hash]
        self._slots.move_to_end(block_hash)
        self._states.copy_slot(self._storage, snapshot_slot, slot)

    def drop(self, block_hash: int) -> bool:
        """Forget the snapshot of `block_hash`; whether there was one."""
        snapshot_slot = self._slots.pop(block_hash, None)
        if snapshot_slot is None:
            return False
        self._free_slots.append(snapshot_slot)
        return True
