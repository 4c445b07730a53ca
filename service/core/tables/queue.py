"""The admission queue: mechanism only, it knows no limits and reads no config.

Two orders, as vLLM v1 keeps FCFS and priority order behind one queue interface
(chosen by service/core/decide/orders.py, apart from the batching policy):
- `FcfsQueue`: arrival order; requeued sequences go back to the head (fifo, budget).
- `FairQueue` (service/core/tables/fair_queue.py): priority bands with aging, tenants by
  least service, first come first served inside a tenant (fair).

Both answer `position` in O(log n) and hand candidates out lazily, so a decision that
admits k sequences costs O(k log n), not O(queue).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from sortedcontainers import SortedList

# Queue depth per priority band is reported over these bands (a bounded metric label).
PRIORITY_BANDS = ("<0", "0", "1-3", "4-9", ">=10")


def priority_band(priority: int) -> str:
    """The fixed band `priority` falls in (lower priority values are more urgent)."""
    if priority < 0:
        return "<0"
    if priority == 0:
        return "0"
    if priority <= 3:
        return "1-3"
    return "4-9" if priority <= 9 else ">=10"


class Queued(Protocol):
    """What the queue reads of a sequence (service.core.tables.sequences.Sequence has it)."""

    seq_id: int
    # Ascending keys are FCFS order; assigned by the queue, kept for storage.
    queue_key: int
    # Scheduler-clock time of the first submission (requeues keep it).
    arrived_at: float

    @property
    def priority(self) -> int: ...

    @property
    def tenant(self) -> str: ...

    @property
    def adapter_id(self) -> str: ...

    def num_tokens(self) -> int:
        """Tokens a worker prefills to (re)start it (unchanged while queued)."""


# How much service a tenant has had so far (weighted tokens), as the fair order reads it.
TenantCounter = Callable[[str], float]


class AdmissionQueue(Protocol):
    """Queued sequences in one queue order (service/core/decide/orders.py)."""

    def __len__(self) -> int: ...

    def __contains__(self, seq_id: int) -> bool: ...

    def push_back(self, seq: Queued) -> None:
        """A new submission: at the tail of its place."""

    def requeue(self, seqs: list[Queued]) -> None:
        """Sequences back from a worker, in the order given (FCFS: ahead of all)."""

    def restore(self, seqs: Iterable[Queued]) -> None:
        """Rebuild from stored sequences (their queue_key and arrived_at as saved)."""

    def adopt(self, seqs: Iterable[Queued]) -> None:
        """Add sequences this queue did not hold, at their place by queue_key and
        arrived_at as saved (a replica claiming from a shared queue). Keys may repeat
        those of queued ids: ties go by seq_id."""

    def remove(self, seq_id: int) -> bool:
        """Drop an id wherever it is; False if it was not queued."""

    def candidates(self, now: float, counter: TenantCounter) -> Iterator[int]:
        """Queued ids in admission order, lazily; the queue must not change meanwhile."""

    def position(self, seq_id: int, now: float, counter: TenantCounter) -> int:
        """How many queued ids come before `seq_id` (KeyError if not queued)."""

    def count(self, tenant: str) -> int:
        """How many queued ids belong to `tenant`."""

    def depth_by_band(self) -> dict[str, int]:
        """Queued ids per band of PRIORITY_BANDS."""

    def count_by_adapter(self) -> dict[str, int]:
        """Queued ids per adapter_id, of those that have one."""

    def tokens_up_to(self, priority: int) -> int:
        """Prefill tokens of the queued ids of this priority or a more urgent one."""


class QueueBase:
    """What both orders share: FCFS order keys (kept for storage, so a restart under any
    policy finds the arrival order: the tail counts up, the head counts down) and
    per-tenant and per-priority counts. A subclass keeps the order (`_insert`, `remove`,
    `candidates`, `position`)."""

    def __init__(self) -> None:
        self._per_tenant: Counter[str] = Counter()
        self._per_priority: Counter[int] = Counter()
        self._per_adapter: Counter[str] = Counter()  # adapters other than ""
        self._tokens_per_priority: Counter[int] = Counter()
        self._head_key = 0  # key of the last id pushed to the head
        self._tail_key = 0  # key of the last id pushed to the tail

    def push_back(self, seq: Queued) -> None:
        self._tail_key += 1
        seq.queue_key = self._tail_key
        self._insert(seq)

    def requeue(self, seqs: list[Queued]) -> None:
        for seq in reversed(seqs):
            self._head_key -= 1
            seq.queue_key = self._head_key
            self._insert(seq)

    def restore(self, seqs: Iterable[Queued]) -> None:
        assert not len(self), "restore into a non-empty queue"
        self.adopt(seqs)

    def adopt(self, seqs: Iterable[Queued]) -> None:
        for seq in seqs:
            self._head_key = min(self._head_key, seq.queue_key)
            self._tail_key = max(self._tail_key, seq.queue_key)
            self._insert(seq)

    def count(self, tenant: str) -> int:
        return self._per_tenant[tenant]

    def count_by_adapter(self) -> dict[str, int]:
        return dict(self._per_adapter)

    def depth_by_band(self) -> dict[str, int]:
        depth = dict.fromkeys(PRIORITY_BANDS, 0)
        for priority, num in self._per_priority.items():
            depth[priority_band(priority)] += num
        return depth

    def tokens_up_to(self, priority: int) -> int:
        return sum(n for p, n in self._tokens_per_priority.items() if p <= priority)

    def __len__(self) -> int:
        raise NotImplementedError

    def _insert(self, seq: Queued) -> None:
        """Add `seq` (its queue_key set) to the order, and count it."""
        raise NotImplementedError

    def _counted(self, seq: Queued) -> None:
        self._per_tenant[seq.tenant] += 1
        self._per_priority[seq.priority] += 1
        if seq.adapter_id:
            self._per_adapter[seq.adapter_id] += 1
        self._tokens_per_priority[seq.priority] += seq.num_tokens()

    def _uncounted(self, seq: Queued) -> None:
        _decrement(self._per_tenant, seq.tenant)
        _decrement(self._per_priority, seq.priority)
        if seq.adapter_id:
            _decrement(self._per_adapter, seq.adapter_id)
        tokens = self._tokens_per_priority
        tokens[seq.priority] -= seq.num_tokens()
        if not self._per_priority.get(seq.priority):
            del tokens[seq.priority]


def _decrement(counter: Counter, key) -> None:
    """One fewer of `key`; a key counted to 0 is deleted (the counters stay bounded)."""
    counter[key] -= 1
    if not counter[key]:
        del counter[key]


class FcfsQueue(QueueBase):
    """First come, first served; requeued ids go to the head, in the order given.

    Order keys are integers: the tail counts up, the head counts down, so sorting by key
    gives the order back after a restart without renumbering anything. Sequences adopted
    from a shared queue may bring keys already in use; (key, seq_id) orders them.
    """

    def __init__(self) -> None:
        super().__init__()
        self._keys = SortedList()  # (queue_key, seq_id)
        self._by_key: dict[tuple[int, int], Queued] = {}
        self._key_of: dict[int, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self._key_of)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._key_of

    def remove(self, seq_id: int) -> bool:
        key = self._key_of.pop(seq_id, None)
        if key is None:
            return False
        self._keys.remove(key)
        self._uncounted(self._by_key.pop(key))
        return True

    def candidates(self, now: float, counter: TenantCounter) -> Iterator[int]:
        return (key[1] for key in self._keys)

    def position(self, seq_id: int, now: float, counter: TenantCounter) -> int:
        return self._keys.bisect_left(self._key_of[seq_id])

    def _insert(self, seq: Queued) -> None:
        assert seq.seq_id not in self._key_of, f"seq_id {seq.seq_id} queued twice"
        key = (seq.queue_key, seq.seq_id)
        self._key_of[seq.seq_id] = key
        self._by_key[key] = seq
        self._keys.add(key)
        self._counted(seq)
