"""No page or snapshot leaks: a property test over random submits, finishes, cancels,
preemptions (tight pools) and cache evictions on the reference engine."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.block_hash import block_hashes
from worker_client.engine.api import ChunkWork, SequenceSpec

from .factories import make_engine, random_prompt

BLOCK = 8
PREFIXES = [random_prompt(24, seed=s) for s in range(3)]

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(0, 2), st.integers(1, 20), st.booleans()),
        st.tuples(st.just("step"), st.sampled_from([3, 8, 16, 24])),  # mostly block-aligned
        st.tuples(st.just("cancel"), st.integers(0, 7)),
        st.tuples(st.just("clear")),
    ),
    min_size=10,
    max_size=40,
)


def _check_books(engine, resume_points: set[int]) -> None:
    kv, cache = engine._pages, engine.prefix_cache
    free = set(kv._free_pages)
    assert len(free) == len(kv._free_pages), "a page twice in the free list"
    mapped = {p for table in kv._page_tables.values() for p in table}
    indexed = {p for h in cache._index.hashes() for p in cache._index.pages(h)}
    assert not free & (mapped | indexed), "a free page is still mapped"
    assert len(free | mapped | indexed) == engine.total_kv_pages, "a page leaked"
    assert engine.kv_free_pages() == len(free) + engine.kv_cached_pages()
    snapshots = cache._snapshots
    assert len(snapshots) + snapshots.num_free_slots() == snapshots.num_slots
    assert all(h in cache._index for h in snapshots.hashes()), "a snapshot outlived its block"
    assert resume_points == set(cache.resume_points()), "the reported resume points drifted"


# About 2.5 s an example here (40 steps of the tiny model): slow, not in the fast loop.
@pytest.mark.slow
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=_ops)
def test_after_all_end_and_the_cache_is_cleared_the_pools_are_whole(tiny_model, ops):
    engine = make_engine(
        tiny_model,
        total_kv_pages=20,
        page_size=4,
        total_gdn_slots=4,
        cache_block_tokens=BLOCK,
        total_snapshot_slots=3,
    )
    specs: dict[int, SequenceSpec] = {}
    cursors: dict[int, int] = {}
    resume_points: set[int] = set()
    admissions: list[ChunkWork] = []
    next_id = 0

    def sync():
        delta = engine.cache_delta()
        assert not set(delta.added) & resume_points and set(delta.removed) <= resume_points
        resume_points.update(delta.added)
        resume_points.difference_update(delta.removed)

    for op in ops:
        if op[0] == "submit":
            _, prefix, tail, use_cache = op
            spec = SequenceSpec((*PREFIXES[prefix], *random_prompt(tail, seed=next_id)), 6)
            hashes = block_hashes(spec.prompt_token_ids, "", BLOCK)
            cached = (
                max(
                    [
                        (i + 1) * BLOCK
                        for i, h in enumerate(hashes)
                        if h in resume_points and (i + 1) * BLOCK < len(spec.prompt_token_ids)
                    ]
                    or [0]
                )
                if use_cache
                else 0
            )
            specs[next_id] = spec
            admissions.append(
                ChunkWork(
                    next_id,
                    cached,
                    min(8, len(spec.prompt_token_ids) - cached),
                    spec,
                    cached_tokens=cached,
                )
            )
            cursors[next_id] = cached + admissions[-1].chunk_len
            next_id += 1
        elif op[0] == "step":
            budget = op[1]
            prefill = list(admissions)
            for seq_id in engine.waiting_ids():
                if seq_id in cursors and budget > 0:
                    n = min(budget, len(specs[seq_id].prompt_token_ids) - cursors[seq_id])
                    prefill.append(ChunkWork(seq_id, cursors[seq_id], n, None))
                    cursors[seq_id] += n
                    budget -= n
            admissions.clear()
            out = engine.step(prefill, engine.running_ids())
            for seq_id in [*out.cache_misses, *out.preempted, *(f.seq_id for f in out.finished)]:
                cursors.pop(seq_id, None)
        elif op[0] == "cancel":
            held = [*engine.waiting_ids(), *engine.running_ids()]
            if held:
                victim = held[op[1] % len(held)]
                engine.evict([victim])
                cursors.pop(victim, None)
        else:
            engine.clear_prefix_cache()
        sync()
        _check_books(engine, resume_points)
    engine.evict([*engine.waiting_ids(), *engine.running_ids()])
    engine.clear_prefix_cache()
    sync()
    _check_books(engine, resume_points)
    assert engine._pages.num_free_pages() == engine.total_kv_pages
    assert engine.gdn_free_slots() == engine.total_gdn_slots
    assert engine.prefix_cache.num_snapshots() == 0 and resume_points == set()
