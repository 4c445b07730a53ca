"""The `fair` policy's queue order (docs/contract.md, "Policies").

1. Priority bands, most urgent (lowest `priority`) first. A sequence's band improves by
   one for every `aging_seconds` it has waited since its first submission, so nothing
   waits forever behind more urgent work.
2. Inside a band, tenants by least service so far (the caller's counter: the Virtual
   Token Counter of "Fairness in Serving Large Language Models", OSDI 2024).
3. Inside a tenant, first come first served by first submission; a requeued sequence
   keeps its arrival, so it goes back to the head of its place, not to the tail.

Sequences sharing (priority, tenant) sit in one list sorted by arrival. Along such a
list the sort key (band, counter, arrival, seq_id) never decreases (older means a
better band; the tenant's counter is one number), so the global order is a k-way merge
of the lists, produced lazily from a heap: O(groups + k log groups) for k candidates.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator

from sortedcontainers import SortedList

from service.core.tables.queue import QueueBase, Queued, TenantCounter

_Group = tuple[int, str]  # (priority, tenant)


class FairQueue(QueueBase):
    """Queued sequences in the fair order; see the module docstring."""

    def __init__(self, aging_seconds: float) -> None:
        super().__init__()
        assert aging_seconds > 0
        self._aging_seconds = aging_seconds
        self._groups: dict[_Group, SortedList] = {}  # (arrived_at, seq_id) per group
        self._seqs: dict[int, Queued] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def remove(self, seq_id: int) -> bool:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return False
        group = self._group(seq)
        entries = self._groups[group]
        entries.remove((seq.arrived_at, seq_id))
        if not entries:
            del self._groups[group]
        self._uncounted(seq)
        return True

    def _group(self, seq: Queued) -> _Group:
        return (seq.priority, seq.tenant)

    def band(self, priority: int, arrived_at: float, now: float) -> int:
        """The effective band: the priority, one better per aging period waited."""
        return priority - math.floor(max(0.0, now - arrived_at) / self._aging_seconds)

    def candidates(self, now: float, counter: TenantCounter) -> Iterator[int]:
        groups = list(self._groups.items())
        served_of: dict[str, float] = {}
        heap = []
        for index, ((priority, tenant), entries) in enumerate(groups):
            served = served_of.get(tenant)
            if served is None:
                served = served_of[tenant] = counter(tenant)
            arrived_at, seq_id = entries[0]
            heap.append(
                (self.band(priority, arrived_at, now), served, arrived_at, seq_id, index, 0)
            )
        heapq.heapify(heap)
        while heap:
            band, served, arrived_at, seq_id, index, position = heapq.heappop(heap)
            (priority, tenant), entries = groups[index]
            if counter(tenant) != served:
                # The tenant was served since this entry was keyed: counters only grow,
                # so re-keying on the way out keeps the merge exact.
                heapq.heappush(heap, (band, counter(tenant), arrived_at, seq_id, index, position))
                continue
            yield seq_id
            position += 1
            if position < len(entries):
                arrived_at, seq_id = entries[position]
                heapq.heappush(
                    heap,
                    (
                        self.band(priority, arrived_at, now),
                        counter(tenant),
                        arrived_at,
                        seq_id,
                        index,
                        position,
                    ),
                )

    def position(self, seq_id: int, now: float, counter: TenantCounter) -> int:
        """O(groups x log n): in each group, binary searches by arrival find the entries
        of better bands, and those of the same band that sort before it."""
        seq = self._seqs[seq_id]
        band = self.band(seq.priority, seq.arrived_at, now)
        served = counter(seq.tenant)
        ahead = 0
        for (priority, tenant), entries in self._groups.items():
            same_band = self._first_of_band(entries, priority, band, now)
            next_band = self._first_of_band(entries, priority, band + 1, now)
            ahead += same_band
            group_served = counter(tenant)
            if group_served < served:
                ahead += next_band - same_band
            elif group_served == served:
                earlier = entries.bisect_left((seq.arrived_at, seq_id))
                ahead += min(max(earlier, same_band), next_band) - same_band
        return ahead

    def _first_of_band(self, entries: SortedList, priority: int, band: int, now: float) -> int:
        """Index of the first entry whose band is `band` or worse (bands only grow along
        a group, from the oldest entry)."""
        # band(a) >= band  <=>  a > now - (priority - band + 1) * aging_seconds; the
        # bisection by that arrival is then corrected for rounding at the boundary.
        threshold = now - (priority - band + 1) * self._aging_seconds
        index = entries.bisect_right((threshold, math.inf))
        while index > 0 and self.band(priority, entries[index - 1][0], now) >= band:
            index -= 1
        while index < len(entries) and self.band(priority, entries[index][0], now) < band:
            index += 1
        return index

    def _insert(self, seq: Queued) -> None:
        assert seq.seq_id not in self._seqs, f"seq_id {seq.seq_id} queued twice"
        self._seqs[seq.seq_id] = seq
        group = self._group(seq)
        entries = self._groups.get(group)
        if entries is None:
            entries = self._groups[group] = SortedList()
        entries.add((seq.arrived_at, seq.seq_id))
        self._counted(seq)


class DeadlineQueue(FairQueue):
    """Priority bands with aging, earliest deadline first inside a band (the deadline
    order, service/core/decide/orders.py): the fair order with every tenant in one group, so
    a decision merges one list per priority, not one per priority and tenant."""

    def _group(self, seq: Queued) -> _Group:
        return (seq.priority, "")
