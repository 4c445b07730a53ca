"""The fair order (service/core/tables/fair_queue.py) against a brute-force sort of its keys."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from service.core.tables.fair_queue import FairQueue
from service.core.tables.queue import FcfsQueue


@dataclass
class Item:
    seq_id: int
    priority: int
    tenant: str
    arrived_at: float
    queue_key: int = 0
    adapter_id: str = ""
    prompt_len: int = 10

    def num_tokens(self) -> int:
        return self.prompt_len


def brute_key(item: Item, now: float, aging: float, served: dict[str, float]):
    band = item.priority - math.floor(max(0.0, now - item.arrived_at) / aging)
    return (band, served.get(item.tenant, 0.0), item.arrived_at, item.seq_id)


items_strategy = st.lists(
    st.tuples(
        st.integers(-2, 3),
        st.sampled_from("abcd"),
        st.integers(0, 400).map(lambda tenths: tenths / 10),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    entries=items_strategy,
    aging=st.sampled_from([0.5, 1.0, 3.0]),
    now_tenths=st.integers(0, 600),
    served=st.dictionaries(st.sampled_from("abcd"), st.integers(0, 50).map(float)),
)
def test_candidates_and_positions_follow_band_then_service_then_arrival(
    entries, aging, now_tenths, served
):
    now = now_tenths / 10
    queue = FairQueue(aging)
    items = [Item(i + 1, p, t, a) for i, (p, t, a) in enumerate(entries)]
    for item in items:
        queue.push_back(item)
    expected = [i.seq_id for i in sorted(items, key=lambda i: brute_key(i, now, aging, served))]
    counter = lambda tenant: served.get(tenant, 0.0)  # noqa: E731
    assert list(queue.candidates(now, counter)) == expected
    assert [queue.position(s, now, counter) for s in expected] == list(range(len(expected)))


@settings(max_examples=200, deadline=None)
@given(entries=items_strategy, charges=st.lists(st.integers(1, 20), max_size=60))
def test_charges_made_while_iterating_reorder_the_rest_like_a_fresh_sort(entries, charges):
    """Each candidate taken charges its tenant; every next candidate is the least key
    under the counters as they are then."""
    queue = FairQueue(1000.0)  # no aging within the test
    items = {i + 1: Item(i + 1, p, t, a) for i, (p, t, a) in enumerate(entries)}
    for item in items.values():
        queue.push_back(item)
    served: dict[str, float] = {}
    remaining = dict(items)
    taken = []
    for step, seq_id in enumerate(queue.candidates(0.0, lambda t: served.get(t, 0.0))):
        best = min(remaining.values(), key=lambda i: brute_key(i, 0.0, 1000.0, served))
        assert seq_id == best.seq_id
        del remaining[seq_id]
        taken.append(seq_id)
        tenant = items[seq_id].tenant
        served[tenant] = served.get(tenant, 0.0) + (charges[step] if step < len(charges) else 1)
    assert sorted(taken) == sorted(items)


@given(st.lists(st.booleans(), min_size=1, max_size=40))
def test_fcfs_positions_and_candidates_agree_after_requeues_and_removals(ops):
    queue = FcfsQueue()
    order: list[int] = []
    items = {}
    for i, requeue in enumerate(ops):
        item = Item(i + 1, 0, "", 0.0)
        items[item.seq_id] = item
        if requeue:
            queue.requeue([item])
            order.insert(0, item.seq_id)
        else:
            queue.push_back(item)
            order.append(item.seq_id)
        if i % 3 == 2:
            queue.remove(order.pop(len(order) // 2))
    assert list(queue.candidates(0.0, lambda t: 0.0)) == order
    assert [queue.position(s, 0.0, lambda t: 0.0) for s in order] == list(range(len(order)))


def test_queued_tokens_are_counted_per_priority_through_requeues_and_removals():
    for queue in (FcfsQueue(), FairQueue(30.0)):
        queue.push_back(Item(1, -1, "a", 0.0, prompt_len=100))
        queue.push_back(Item(2, 0, "a", 1.0, prompt_len=30))
        queue.requeue([Item(3, -2, "b", 0.5, prompt_len=7)])
        assert (queue.tokens_up_to(-2), queue.tokens_up_to(-1), queue.tokens_up_to(5)) == (
            7,
            107,
            137,
        )
        queue.remove(1)
        assert (queue.tokens_up_to(-1), queue.tokens_up_to(0)) == (7, 37)
        queue.remove(3)
        queue.remove(2)
        assert queue.tokens_up_to(10) == 0
