"""The routers on arrival: each follows its source's rule on what it sees of the fleet,
and in a simulation each worker's own prefix cache serves what is routed to it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest

from service.core import FinishReason, SchedulerConfig
from service.sim.routing import ROUTINGS, make_router
from service.sim.simulator import RunSpec, Simulation, WorkerShape
from service.sim.workload import Request
from tests.sim.factories import LinearCost

B = 16


@dataclass
class Fleet:
    """A FleetView with the figures set by hand."""

    num_workers: int
    block_tokens: int = B
    cached: dict[int, int] = field(default_factory=dict)  # worker -> cached blocks
    outstanding: list[int] = None
    waiting: list[int] = None
    usage: list[float] = None
    blocks: list[int] = None
    prefill: list[int] = None

    def __post_init__(self):
        n = self.num_workers
        for name in ("outstanding", "waiting", "blocks", "prefill"):
            if getattr(self, name) is None:
                setattr(self, name, [0] * n)
        if self.usage is None:
            self.usage = [0.0] * n

    def cached_blocks(self, w, hashes):
        return min(self.cached.get(w, 0), len(hashes))

    def num_outstanding(self, w):
        return self.outstanding[w]

    def num_waiting(self, w):
        return self.waiting[w]

    def kv_usage(self, w):
        return self.usage[w]

    def active_blocks(self, w):
        return self.blocks[w]

    def active_prefill_tokens(self, w):
        return self.prefill[w]


HASHES = list(range(10))  # a prompt of 10 full blocks and a bit
PROMPT = 10 * B + 1


def test_kv_router_weighs_the_blocks_saved_against_the_decode_blocks_held():
    router = make_router("kv-router", seed=0)
    # Worker 1 has 8 of the 10 blocks: prefill 2.06 blocks there against 10.06.
    assert router.pick(Fleet(2, cached={1: 8}), PROMPT, HASHES) == 1
    # ... unless it holds more than 8 decode blocks more than worker 0.
    assert router.pick(Fleet(2, cached={1: 8}, blocks=[0, 9]), PROMPT, HASHES) == 0
    assert router.pick(Fleet(2, cached={1: 8}, blocks=[0, 7]), PROMPT, HASHES) == 1
    # Pending prefill counts as prefill blocks.
    assert router.pick(Fleet(2, cached={1: 8}, prefill=[0, 9 * B]), PROMPT, HASHES) == 0


def test_prefix_load_sums_its_weighted_scores():
    router = make_router("prefix-load", seed=0)
    # Worker 0: queue 1 + KV 1; worker 1: prefix 2 x 0.4 + queue 0 + KV 1.
    fleet = Fleet(2, cached={1: 4}, waiting=[0, 4])
    assert router.pick(fleet, PROMPT, HASHES) == 0
    # Equal scores: a seeded random choice among the tied, both get some.
    assert {router.pick(Fleet(2), PROMPT, HASHES) for _ in range(20)} == {0, 1}
    fleet = Fleet(2, cached={1: 6}, waiting=[0, 4])
    assert router.pick(fleet, PROMPT, HASHES) == 1  # 1.2 + 1 > 0 + 1 + 1
    fleet = Fleet(2, cached={1: 6}, waiting=[0, 4], usage=[0.0, 0.5])
    assert router.pick(fleet, PROMPT, HASHES) == 0  # 1.2 + 0.5 < 2


def test_cache_aware_follows_its_tree_above_the_threshold_and_balances_when_imbalanced():
    router = make_router("cache-aware", seed=0)
    fleet = Fleet(3)
    first = router.pick(fleet, PROMPT, HASHES)  # no match: the smallest tree
    assert router.pick(fleet, PROMPT, HASHES) == first  # its tree has the whole prompt
    other = router.pick(fleet, PROMPT, [100 + h for h in HASHES])
    assert other != first  # a new prefix goes to a smallest (empty) tree
    # 3 of 10 blocks (0.3 of the prompt) is not above the threshold: the smallest tree.
    third = router.pick(fleet, PROMPT, HASHES[:3] + [200 + h for h in range(7)])
    assert third not in (first, other)
    # Imbalanced (max - min > 64 and max > 1.5 x min): the least loaded, whatever matches.
    loads = [100, 100, 100]
    loads[third] = 10
    assert router.pick(Fleet(3, outstanding=loads), PROMPT, HASHES) == third
    # ... and the prompt joined that worker's tree.
    loads[third] = 40  # 60 apart: balanced, the trees decide again
    assert router.pick(Fleet(3, outstanding=loads), PROMPT, [100 + h for h in HASHES]) == other
    assert {router.pick(Fleet(3), PROMPT, HASHES) for _ in range(20)} == {first, third}


def conversation(num_turns: int, *, gap: float = 1.0) -> list[Request]:
    """One conversation: each turn's prompt is the previous one plus 2 new blocks."""
    return [
        Request(t, t * gap, (3 + 2 * t) * B, 4, tuple(range(3 + 2 * t)), B)
        for t in range(num_turns)
    ]


def run(reqs, routing, *, workers=2, config=None, snapshot_slots=None):
    config = config or SchedulerConfig(chunk_size=64, policy="fifo")
    shape = WorkerShape(256, 4, 16, cache_block_tokens=B, snapshot_slots=snapshot_slots)
    return Simulation(RunSpec(config, shape, workers, routing), LinearCost(), reqs).run()


@pytest.mark.parametrize("routing", ROUTINGS)
def test_every_request_finishes_once_with_caches_under_every_routing(routing):
    reqs = conversation(6, gap=0.3) + [
        Request(6 + i, 0.1 * i, 40, 5, (50 + i, 60, 61), B) for i in range(10)
    ]
    reqs = sorted(reqs, key=lambda r: r.arrival_seconds)
    reqs = [
        Request(i, r.arrival_seconds, r.prompt_len, r.output_len, r.hash_ids, B)
        for i, r in enumerate(reqs)
    ]
    outcome = run(reqs, routing)
    for record, request in zip(outcome.records, reqs):
        assert record.num_finishes == 1 and record.finish_reason is FinishReason.MAX_LENGTH
        assert record.num_tokens == request.output_len
    prompt_tokens = sum(r.prompt_len for r in reqs)
    assert outcome.computed_prefill_tokens + outcome.cached_prefill_tokens >= prompt_tokens


@pytest.mark.parametrize("routing", ["kv-router", "prefix-load", "cache-aware"])
def test_the_cache_routers_send_each_turn_where_the_conversation_is_cached(routing):
    reqs = conversation(5)
    outcome = run(reqs, routing, workers=3)
    assert len({r.worker_id for r in outcome.records}) == 1
    # Every later turn resumes from all of the previous prompt's blocks.
    expected = sum((1 + 2 * t) * B for t in range(1, 5))
    assert outcome.cached_prefill_tokens == expected
    assert outcome.computed_prefill_tokens == sum(r.prompt_len for r in reqs) - expected
    assert outcome.cache_misses == 0


def test_round_robin_spreads_a_conversation_and_loses_its_cache():
    outcome = run(conversation(4), "round-robin", workers=2)
    assert [r.worker_id for r in outcome.records] == ["sim-0", "sim-1", "sim-0", "sim-1"]
    # Turn t resumes only from turn t - 2 on the same worker: 3 and 5 blocks.
    assert outcome.cached_prefill_tokens == 3 * B + 5 * B


def test_a_hybrid_models_snapshot_slots_bound_what_it_resumes():
    # Two conversations taking turns on one worker: with one snapshot slot each prompt's
    # snapshot evicts the other conversation's, so no turn finds its resume point.
    a, b = conversation(4, gap=1.0), conversation(4, gap=1.0)
    reqs = []
    for t in range(4):
        reqs.append(Request(2 * t, 2.0 * t, a[t].prompt_len, 4, a[t].hash_ids, B))
        reqs.append(
            Request(
                2 * t + 1, 2.0 * t + 1, b[t].prompt_len, 4, tuple(100 + h for h in b[t].hash_ids), B
            )
        )
    many = run(reqs, "kv-router", workers=1, snapshot_slots=64)
    one = run(reqs, "kv-router", workers=1, snapshot_slots=1)
    assert many.cached_prefill_tokens == 2 * (3 + 5 + 7) * B
    assert one.cached_prefill_tokens < many.cached_prefill_tokens
    assert one.computed_prefill_tokens > many.computed_prefill_tokens


def test_pull_spreads_a_light_load_whose_prompts_share_only_their_first_block():
    """Issue 32: every prompt starts with the same block (a system prompt) and 9 of its
    own. Before, the first worker to hold that block took nearly every request, the
    idle ones deferring to it; the block saves a tenth of each prefill, less than the
    holder's batch pays for carrying the rest."""
    reqs = [
        Request(i, 0.25 * i, 10 * B, 60, (0, *range(100 + 10 * i, 109 + 10 * i)), B)
        for i in range(40)
    ]
    outcome = run(reqs, "pull", workers=4)
    shares = Counter(r.worker_id for r in outcome.records)
    assert max(shares.values()) <= 1.5 * len(reqs) / 4, shares  # main: all 40 on one


def test_pull_keeps_each_conversation_on_the_worker_that_holds_it_at_light_load():
    reqs = sorted(
        (
            Request(
                0,
                c * 0.2 + t * 2.0,
                (3 + 2 * t) * B,
                20,
                tuple(range(1000 * c, 1000 * c + 3 + 2 * t)),
                B,
            )
            for c in range(4)
            for t in range(3)
        ),
        key=lambda r: r.arrival_seconds,
    )
    reqs = [
        Request(i, r.arrival_seconds, r.prompt_len, r.output_len, r.hash_ids, B)
        for i, r in enumerate(reqs)
    ]
    outcome = run(reqs, "pull", workers=2)
    # Every follow-up resumes from all of its previous prompt's blocks.
    assert outcome.cached_prefill_tokens == 4 * sum((1 + 2 * t) * B for t in range(1, 3))
    shares = Counter(r.worker_id for r in outcome.records)
    assert min(shares.values()) >= 0.3 * len(reqs), shares
