"""ScriptedEngine keeps the reference engine's prefix-cache books: the same decisions give
the same free and cached pages, resume points, hits and misses after every step."""

from __future__ import annotations

import dataclasses

import torch

from common.block_hash import block_hashes
from worker_client.engine.api import ChunkWork, SequenceSpec
from worker_client.engine.config import tiny_config
from worker_client.engine.engine import ModelEngine
from worker_client.engine.loading import random_model
from worker_client.testing import ScriptedEngine

from .factories import random_prompt

BLOCK, PAGE = 8, 4
SYSTEM = random_prompt(16, seed=40)


def _spec(seed: int, tail: int, max_new_tokens: int = 4) -> SequenceSpec:
    return SequenceSpec((*SYSTEM, *random_prompt(tail, seed=seed)), max_new_tokens)


def test_scripted_engine_keeps_the_same_cache_books_as_the_reference_engine():
    model = random_model(dataclasses.replace(tiny_config(), eos_token_ids=()), seed=0).eval()
    pools = dict(
        total_kv_pages=24,
        page_size=PAGE,
        total_gdn_slots=4,
        cache_block_tokens=BLOCK,
        total_snapshot_slots=4,
    )
    reference = ModelEngine(model, device="cpu", **pools)
    scripted = ScriptedEngine(**pools)
    a, b, c = _spec(1, 6), _spec(2, 9), _spec(3, 20)
    h = block_hashes(a.prompt_token_ids, "", BLOCK)
    steps = [
        ([ChunkWork(1, 0, 8, a), ChunkWork(2, 0, 16, b)], []),  # snapshots at 8 and 16
        ([ChunkWork(1, 8, 14, None), ChunkWork(2, 16, 9, None)], []),
        ([], [1, 2]),
        ([], [1, 2]),  # 1 ends (4 tokens); its blocks stay, unused
        ([ChunkWork(3, 16, 16, c, cached_tokens=16)], [2]),  # a hit on the shared prompt
        ([ChunkWork(4, 8, 8, _spec(4, 3), cached_tokens=8)], [3]),  # still there: a hit
        ([], [3, 4]),
        ([ChunkWork(5, 24, 4, _spec(5, 12), cached_tokens=24)], [3, 4]),  # no snapshot: a miss
        # An unrelated big chunk: 13 pages of the 14 free, 2 of them cached (an eviction).
        ([ChunkWork(6, 0, 52, SequenceSpec(random_prompt(56, seed=99), 1))], []),
    ]
    reference_points, scripted_points = set(), set()
    misses, cached_pages = [], []
    with torch.inference_mode():
        for n, (prefill, decode) in enumerate(steps):
            expected, got = reference.step(prefill, decode), scripted.step(prefill, decode)
            assert got.cache_misses == expected.cache_misses, n
            assert got.preempted == expected.preempted, n
            assert [f.seq_id for f in got.finished] == [f.seq_id for f in expected.finished], n
            assert scripted.kv_free_pages() == reference.kv_free_pages(), n
            assert scripted.kv_cached_pages() == reference.kv_cached_pages(), n
            assert scripted.waiting_ids() == reference.waiting_ids(), n
            assert scripted.running_ids() == reference.running_ids(), n
            misses.append(expected.cache_misses)
            cached_pages.append(reference.kv_cached_pages())
            for points, engine in ((reference_points, reference), (scripted_points, scripted)):
                delta = engine.cache_delta()
                points |= set(delta.added)
                points -= set(delta.removed)
            # Resume points depend only on the prompts and generated blocks' hashes where
            # the tokens agree: the shared system prompt's blocks, compared by hash.
            shared = {h[0], h[1]}
            assert reference_points & shared == scripted_points & shared, n
            assert len(reference_points) == len(scripted_points), n
    # The scenario did what its comments say: two hits, one miss, evictions of cache.
    assert misses[4] == misses[5] == () and misses[7] == (5,)
    assert cached_pages[7] > 0 and cached_pages[8] == 0
