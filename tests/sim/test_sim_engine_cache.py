"""SimEngine's prefix cache keeps the reference engine's books: blocks by chained hash,
LRU reclaim, GDN snapshot slots, resume-point deltas, hits and misses, and a cost model
that is charged only the computed tokens."""

from __future__ import annotations

import dataclasses

import pytest

from common.block_hash import block_hashes
from tests.sim.factories import LinearCost, cached_chunk, prompt, sim_engine
from worker_client.engine.api import ChunkWork, FinishReason, SequenceSpec

BLOCK = 8  # two pages of 4


def _run_to_end(engine, seq_id: int) -> None:
    while seq_id in engine.running_ids():
        engine.step([], [seq_id])


def test_a_finished_prompts_blocks_stay_cached_count_as_free_and_are_reported():
    engine = sim_engine(total_kv_pages=16, page_size=4, cache_block_tokens=BLOCK)
    tokens = prompt(0, 1, block_tokens=BLOCK) + (5, 5, 5)  # 2 full blocks and 3 tokens
    engine.step([cached_chunk(1, tokens, 0, len(tokens), max_new_tokens=1)], [])
    assert engine.running_ids() == []  # one token: finished at once
    assert engine.kv_free_pages() == 16 and engine.kv_cached_pages() == 4
    delta = engine.cache_delta()
    assert delta.added == tuple(block_hashes(tokens, "", BLOCK)) and not delta.reset
    assert engine.cache_delta() == type(delta)()  # reported once
    assert engine.cache_delta(full=True).added == delta.added


def test_a_resumed_first_chunk_computes_only_past_its_cached_tokens():
    cost = LinearCost()
    engine = sim_engine(total_kv_pages=16, page_size=4, cache_block_tokens=BLOCK, cost=cost)
    first = prompt(0, 1, block_tokens=BLOCK) + (5,)
    engine.step([cached_chunk(1, first, 0, len(first), max_new_tokens=1)], [])
    second = prompt(0, 1, 2, block_tokens=BLOCK)
    out = engine.step([cached_chunk(2, second, 16, 8)], [])
    assert out.cache_misses == () and [s for s, _ in out.tokens] == [2]
    assert cost.loads[-1].prefill_chunks == ((8, 16),)  # 8 computed, 16 cached as context
    assert engine.num_computed_prefill_tokens == 17 + 8
    assert engine.prefix_cache.num_resumes == 1 and engine.prefix_cache.num_resumed_tokens == 16
    # Shares the two cached blocks' 4 pages; 2 pages of its own for block 2.
    assert engine.num_held_pages(2) == 6 and engine.kv_free_pages() == 16 - 6


def test_a_first_chunk_whose_resume_point_is_gone_is_a_miss_and_holds_nothing():
    engine = sim_engine(total_kv_pages=16, page_size=4, cache_block_tokens=BLOCK)
    out = engine.step([cached_chunk(1, prompt(0, 1, block_tokens=BLOCK), 8, 8)], [])
    assert out.cache_misses == (1,) and out.tokens == () and out.preempted == ()
    assert engine.waiting_ids() == engine.running_ids() == [] and engine.kv_free_pages() == 16
    assert engine.prefix_cache.num_resume_misses == 1


def test_a_sequence_that_may_not_use_the_cache_misses_on_a_cached_first_chunk():
    engine = sim_engine(total_kv_pages=16, page_size=4, cache_block_tokens=BLOCK)
    tokens = prompt(0, 1, block_tokens=BLOCK)
    engine.step([cached_chunk(1, tokens, 0, 16, max_new_tokens=1)], [])
    spec = SequenceSpec(tokens, 2, use_prefix_cache=False)
    out = engine.step([ChunkWork(2, 8, 8, spec, cached_tokens=8)], [])
    assert out.cache_misses == (2,)


def test_a_sequence_that_asks_for_prompt_logprobs_is_never_resumed():
    engine = sim_engine(total_kv_pages=16, page_size=4, cache_block_tokens=BLOCK)
    tokens = prompt(0, 1, block_tokens=BLOCK)
    engine.step([cached_chunk(1, tokens, 0, 16, max_new_tokens=1)], [])
    spec = SequenceSpec(tokens, 2, prompt_logprobs=1)
    assert engine.step([ChunkWork(2, 8, 8, spec, cached_tokens=8)], []).cache_misses == (2,)


def test_without_a_cache_every_cached_first_chunk_is_a_miss():
    engine = sim_engine()
    out = engine.step([cached_chunk(1, prompt(0, 1, block_tokens=4), 4, 4)], [])
    assert out.cache_misses == (1,) and engine.cache_delta() == type(engine.cache_delta())()


def test_cached_tokens_off_the_block_grid_fail_the_sequence_with_a_reason():
    engine = sim_engine(total_kv_pages=16, page_size=4, cache_block_tokens=BLOCK)
    out = engine.step([cached_chunk(1, prompt(0, 1, block_tokens=BLOCK), 4, 12)], [])
    assert out.finished[0].reason is FinishReason.FAILED
    assert "multiple of the cache block" in out.finished[0].error_message


def test_cache_is_reclaimed_least_recently_used_first_when_a_sequence_needs_pages():
    engine = sim_engine(total_kv_pages=8, page_size=4, cache_block_tokens=BLOCK)
    a, b = prompt(0, block_tokens=BLOCK), prompt(1, block_tokens=BLOCK)
    for seq_id, tokens in ((1, a + (5,)), (2, b + (5,))):
        engine.step([cached_chunk(seq_id, tokens, 0, len(tokens), max_new_tokens=1)], [])
    engine.cache_delta()
    assert engine.kv_cached_pages() == 4 and engine.kv_free_pages() == 8
    # 6 pages needed, 4 truly free: block a (least recently used) goes, b stays.
    out = engine.step([cached_chunk(3, prompt(7, 8, 9, block_tokens=BLOCK)[:21], 0, 21)], [])
    assert out.preempted == () and engine.waiting_ids() == []
    (a_hash,) = block_hashes(a, "", BLOCK)
    assert a_hash in engine.cache_delta().removed
    out = engine.step([cached_chunk(4, b + (6,), 8, 1)], [])
    assert out.cache_misses == ()
    assert engine.prefix_cache.num_evicted_blocks == 1


def test_a_hybrid_model_resumes_only_where_a_snapshot_was_taken():
    # Chunks end at 12 (no boundary), 16 and 17: only block 1 gets a snapshot.
    engine = sim_engine(total_kv_pages=16, page_size=4, cache_block_tokens=BLOCK, snapshot_slots=4)
    tokens = prompt(0, 1, block_tokens=BLOCK) + (5,)
    engine.step([cached_chunk(1, tokens, 0, 12, max_new_tokens=1)], [])
    engine.step([ChunkWork(1, 12, 4, None)], [])
    engine.step([ChunkWork(1, 16, 1, None)], [])
    h0, h1 = block_hashes(tokens, "", BLOCK)
    assert engine.cache_delta().added == (h1,)
    assert engine.step([cached_chunk(2, tokens, 8, 9)], []).cache_misses == (2,)
    assert engine.step([cached_chunk(3, tokens, 16, 1)], []).cache_misses == ()


def test_the_snapshot_slots_limit_resume_points_least_recently_used_out():
    engine = sim_engine(total_kv_pages=32, page_size=4, cache_block_tokens=BLOCK, snapshot_slots=1)
    a, b = prompt(0, block_tokens=BLOCK), prompt(1, block_tokens=BLOCK)
    engine.step([cached_chunk(1, a + (5,), 0, 8, max_new_tokens=1)], [])
    engine.step([cached_chunk(2, b + (5,), 0, 8, max_new_tokens=1)], [])
    (b_hash,) = block_hashes(b, "", BLOCK)
    delta = engine.cache_delta()
    assert delta.added == (b_hash,)  # a's snapshot made room for b's before any report
    assert engine.prefix_cache.num_snapshots() == 1 and engine.prefix_cache.num_cached_blocks() == 2
    assert engine.step([cached_chunk(3, a + (6,), 8, 1)], []).cache_misses == (3,)
    assert engine.total_snapshot_slots == 1


def test_pools_are_whole_again_after_every_sequence_ends_and_the_cache_is_cleared():
    engine = sim_engine(
        total_kv_pages=12,
        page_size=4,
        total_gdn_slots=3,
        cache_block_tokens=BLOCK,
        snapshot_slots=2,
    )
    tokens = prompt(0, 1, 2, block_tokens=BLOCK)
    engine.step(
        [
            cached_chunk(1, tokens, 0, 24, max_new_tokens=3),
            cached_chunk(2, tokens, 0, 24, max_new_tokens=9),
        ],
        [],
    )
    engine.step([cached_chunk(3, tokens, 16, 8, max_new_tokens=5)], [1, 2])
    engine.evict([2])
    for seq_id in (1, 3):
        _run_to_end(engine, seq_id)
    assert engine.running_ids() == engine.waiting_ids() == []
    assert engine.kv_cached_pages() > 0
    engine.clear_prefix_cache()
    assert engine.kv_free_pages() == 12 and engine.kv_cached_pages() == 0
    assert engine.gdn_free_slots() == 3 and engine.prefix_cache.num_snapshots() == 0


@pytest.mark.slow
def test_sim_engine_keeps_the_same_cache_books_as_the_reference_engine():
    """The same decisions, with cached first chunks, to ModelEngine (tiny hybrid model) and
    SimEngine with as many snapshot slots: the same free and cached pages, misses,
    preemptions and resume points after every step. The engines' generated tokens differ
    (a model against TOKEN_ID), so resume points are compared on the prompts' blocks by
    hash and in number."""
    torch = pytest.importorskip("torch")
    from worker_client.engine.config import tiny_config
    from worker_client.engine.engine import ModelEngine
    from worker_client.engine.loading import random_model

    model = random_model(dataclasses.replace(tiny_config(), eos_token_ids=()), seed=0).eval()
    pools = dict(total_kv_pages=24, page_size=4, total_gdn_slots=4)
    reference = ModelEngine(
        model, device="cpu", cache_block_tokens=BLOCK, total_snapshot_slots=4, **pools
    )
    sim = sim_engine(cache_block_tokens=BLOCK, snapshot_slots=4, **pools)
    system = prompt(0, 1, block_tokens=BLOCK)
    a, b, c = system + (3,) * 6, system + (4,) * 9, system + (5,) * 20
    prompts = [a, b, c]
    steps = [
        ([cached_chunk(1, a, 0, 8, 4), cached_chunk(2, b, 0, 16, 4)], []),  # snapshots at 8, 16
        ([ChunkWork(1, 8, 14, None), ChunkWork(2, 16, 9, None)], []),
        ([], [1, 2]),
        ([], [1, 2]),  # 1 ends; its blocks stay, unused
        ([cached_chunk(3, c, 16, 16, 4)], [2]),  # a hit on the shared system prompt
        ([cached_chunk(4, system + (6,) * 3, 8, 8, 4)], [3]),  # still there: a hit
        ([], [3, 4]),
        ([cached_chunk(5, system + (7,) * 12, 24, 4, 4)], [3, 4]),  # no such point: a miss
        # An unrelated big chunk: it needs cache reclaimed (an eviction).
        ([cached_chunk(6, tuple(range(100, 156)), 0, 52, 1)], []),
        ([ChunkWork(6, 52, 4, None)], [3, 4]),
        ([cached_chunk(7, tuple(range(100, 156)) + (9,), 56, 1, 2)], []),  # its last block
        ([], [7, 3, 4]),
        ([], [7, 3, 4]),
    ]
    prompt_hashes = {
        h for p in prompts + [tuple(range(100, 156))] for h in block_hashes(p, "", BLOCK)
    }
    points = {id(reference): set(), id(sim): set()}
    misses, cached_pages, preempted = [], [], []
    with torch.inference_mode():
        for n, (prefill, decode) in enumerate(steps):
            expected, got = reference.step(prefill, decode), sim.step(prefill, decode)
            assert got.cache_misses == expected.cache_misses, n
            assert got.preempted == expected.preempted, n
            assert got.finished == expected.finished, n
            assert [s for s, _ in got.tokens] == [s for s, _ in expected.tokens], n
            assert sim.kv_free_pages() == reference.kv_free_pages(), n
            assert sim.kv_cached_pages() == reference.kv_cached_pages(), n
            assert sim.gdn_free_slots() == reference.gdn_free_slots(), n
            assert sim.waiting_ids() == reference.waiting_ids(), n
            assert sim.running_ids() == reference.running_ids(), n
            for engine in (reference, sim):
                delta = engine.cache_delta()
                points[id(engine)] |= set(delta.added)
                points[id(engine)] -= set(delta.removed)
            assert (points[id(reference)] & prompt_hashes) == (points[id(sim)] & prompt_hashes), n
            assert len(points[id(reference)]) == len(points[id(sim)]), n
            assert (
                sim.prefix_cache.num_cached_blocks() == reference.prefix_cache.num_cached_blocks()
            ), n
            assert sim.prefix_cache.num_snapshots() == reference.prefix_cache.num_snapshots(), n
            misses.append(expected.cache_misses)
            cached_pages.append(reference.kv_cached_pages())
            preempted.append(expected.preempted)
    # The scenario did what its comments say: hits, a miss, an eviction, a late hit.
    assert misses[4] == misses[5] == () and misses[7] == (5,) and misses[10] == ()
    assert reference.prefix_cache.num_evicted_blocks > 0
    assert sim.prefix_cache.num_evicted_blocks == reference.prefix_cache.num_evicted_blocks
    assert sim.prefix_cache.num_resumes == reference.prefix_cache.num_resumes == 3
