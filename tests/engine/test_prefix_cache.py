"""The engine's prefix cache: the same greedy tokens with it on and off, less computed.

A small driver plays the scheduler's part (the real scheduler's is
tests/worker/test_prefix_cache_system.py): it
keeps the resume points the engine reports (cache_delta), starts each admission at the
longest one, ends chunks on block boundaries, and admits a missed sequence again from 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from common.block_hash import block_hashes
from worker_client.engine.api import ChunkWork, SequenceSpec

from .factories import make_engine, random_prompt

BLOCK = 8  # tokens per cache block: two pages of 4


@dataclass
class Driver:
    """Runs sequences to completion on an engine, one scheduler's worth of bookkeeping."""

    engine: object
    chunk_size: int = 16
    use_cache: bool = True
    resume_points: set[int] = field(default_factory=set)
    computed_tokens: int = 0
    cached_tokens: int = 0
    misses: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    outputs: dict[int, list[int]] = field(default_factory=dict)

    def sync(self) -> None:
        delta = self.engine.cache_delta()
        if delta.reset:
            self.resume_points.clear()
        assert not set(delta.added) & self.resume_points, "a resume point added twice"
        assert set(delta.removed) <= self.resume_points, "a removal of an unknown resume point"
        self.resume_points |= set(delta.added)
        self.resume_points -= set(delta.removed)

    def resume_at(self, spec: SequenceSpec) -> int:
        if not self.use_cache:
            return 0
        hashes = block_hashes(spec.prompt_token_ids, spec.adapter_id, BLOCK)
        for i in range(len(hashes) - 1, -1, -1):
            if hashes[i] in self.resume_points and (i + 1) * BLOCK < len(spec.prompt_token_ids):
                return (i + 1) * BLOCK
        return 0

    def first_chunk(self, seq_id: int, spec: SequenceSpec, cached: int | None = None) -> ChunkWork:
        cached = self.resume_at(spec) if cached is None else cached
        return ChunkWork(seq_id, cached, self._chunk_len(cached, spec), spec, cached_tokens=cached)

    def _chunk_len(self, start: int, spec: SequenceSpec) -> int:
        end = min(start + self.chunk_size, len(spec.prompt_token_ids))
        if end < len(spec.prompt_token_ids) and end % BLOCK:
            end -= end % BLOCK  # the "align" rule: end on a block boundary where it can
        return end - start

    def run(self, specs: dict[int, SequenceSpec], *, cached: dict[int, int] | None = None) -> None:
        """Admit `specs` together (first chunks in one step), then step until all end."""
        self.sync()
        cursors: dict[int, int] = {}
        pending = [self.first_chunk(s, spec, (cached or {}).get(s)) for s, spec in specs.items()]
        while pending or self.engine.running_ids() or self.engine.waiting_ids():
            prefill = pending + [
                ChunkWork(s, cursors[s], self._chunk_len(cursors[s], specs[s]), None)
                for s in self.engine.waiting_ids()
                if s in cursors
            ]
            pending = []
            out = self.engine.step(prefill, self.engine.running_ids())
            self.sync()
            for chunk in prefill:
                if chunk.seq_id in out.cache_misses:
                    self.misses.append(chunk.seq_id)
                    continue
                self.computed_tokens += chunk.chunk_len
                self.cached_tokens += chunk.cached_tokens
                cursors[chunk.seq_id] = chunk.chunk_start + chunk.chunk_len
            for seq_id, tokens in out.tokens:
                self.outputs.setdefault(seq_id, []).extend(tokens)
            self.preempted.extend(out.preempted)
            for seq_id in [*out.cache_misses, *out.preempted]:
                # Back to the queue: greedy, so run again from its spec (from a resume
                # point the driver still knows) it gives the same tokens.
                cursors.pop(seq_id, None)
                self.outputs[seq_id] = []
                pending.append(self.first_chunk(seq_id, specs[seq_id]))


def _spec(tokens, max_new_tokens=10, adapter_id="") -> SequenceSpec:
    return SequenceSpec(tuple(tokens), max_new_tokens, adapter_id=adapter_id)


def _cached_engine(model, **kwargs):
    kwargs = {
        "total_kv_pages": 128,
        "page_size": 4,
        "total_gdn_slots": 8,
        "cache_block_tokens": BLOCK,
        "total_snapshot_slots": 32,
        **kwargs,
    }
    return make_engine(model, **kwargs)


def _conversation(driver: Driver, num_turns: int = 3) -> list[list[int]]:
    """Each turn's prompt: the last prompt, its answer and a new message; the answers."""
    prompt, answers = list(random_prompt(30, seed=1)), []
    for turn in range(num_turns):
        seq_id = 100 + turn
        driver.run({seq_id: _spec(prompt)})
        answer = driver.outputs[seq_id]
        answers.append(answer)
        prompt = [*prompt, *answer, *random_prompt(12, seed=10 + turn)]
    return answers


def test_a_conversation_gets_the_same_greedy_tokens_and_computes_only_the_new_part(family):
    off = Driver(make_engine(family.ours, total_kv_pages=128, page_size=4))
    on = Driver(_cached_engine(family.ours))
    assert _conversation(on) == _conversation(off)
    # Turn 1: 30 tokens; turns 2 and 3 resume where turn 1's decode crossed a block
    # boundary: each computes at most its new message (answer tail included) + one block.
    assert on.cached_tokens > 0
    assert on.computed_tokens < off.computed_tokens
    assert on.computed_tokens <= 30 + 2 * (12 + 10 + BLOCK)


def test_a_shared_system_prompt_is_computed_once_and_tokens_do_not_change(tiny_model):
    _a_shared_system_prompt_is_computed_once_and_tokens_do_not_change(tiny_model)


def _a_shared_system_prompt_is_computed_once_and_tokens_do_not_change(tiny_model):
    system = random_prompt(24, seed=2)
    specs = {i: _spec([*system, *random_prompt(5 + i, seed=20 + i)]) for i in range(4)}
    off, on = Driver(make_engine(tiny_model)), Driver(_cached_engine(tiny_model))
    off.run(dict(specs))
    on.run({0: specs[0]})  # the first one computes the system prompt ...
    on.run({i: specs[i] for i in range(1, 4)})  # ... the others start past it
    assert on.outputs == off.outputs
    # The first one's steps ended on block boundaries at 16 (its first chunk) and 32 (a
    # decode): the others resume at 16, the last boundary inside the shared 24 tokens.
    assert on.cached_tokens == 3 * 16
    # Pages of the system prompt are one copy, held by the cache once all ended.
    assert on.engine.prefix_cache.num_cached_blocks() >= 3


def test_sequences_computing_the_same_blocks_at_once_share_one_copy(tiny_model):
    system = random_prompt(24, seed=3)
    engine = _cached_engine(tiny_model)
    engine.step([ChunkWork(i, 0, 24, _spec([*system, 7, 8, 9])) for i in range(3)], [])
    # Three sequences, 24 tokens = 6 pages each, 3 blocks shared: 6 pages, not 18.
    assert engine.total_kv_pages - engine.kv_free_pages() == 6
    assert engine.prefix_cache.num_cached_blocks() == 3


def test_prompts_diverging_inside_a_block_resume_at_the_block_before(tiny_model):
    _prompts_diverging_inside_a_block_resume_at_the_block_before(tiny_model)


def _prompts_diverging_inside_a_block_resume_at_the_block_before(tiny_model):
    first = list(random_prompt(40, seed=4))
    second = [*first[:13], *random_prompt(20, seed=5)]  # equal up to token 13: block 1 differs
    # Chunks of one block: every block boundary of the first prompt gets a snapshot.
    off = Driver(make_engine(tiny_model), chunk_size=BLOCK)
    on = Driver(_cached_engine(tiny_model), chunk_size=BLOCK)
    for driver in (off, on):
        driver.run({1: _spec(first)})
        driver.run({2: _spec(second)})
    assert on.outputs == off.outputs
    assert on.cached_tokens == BLOCK


def test_another_adapter_never_resumes_from_the_base_models_blocks(tiny_model):
    _another_adapter_never_resumes_from_the_base_models_blocks(tiny_model)


def _another_adapter_never_resumes_from_the_base_models_blocks(tiny_model):
    prompt = list(random_prompt(40, seed=6))
    on = Driver(_cached_engine(tiny_model))
    on.run({1: _spec(prompt)})
    on.run({2: _spec(prompt, adapter_id="tenant-a")})
    assert on.cached_tokens == 0
    on.run({3: _spec(prompt, adapter_id="tenant-a")})
    assert on.cached_tokens > 0


def test_eviction_between_turns_and_a_miss_still_give_the_same_tokens(tiny_model):
    _eviction_between_turns_and_a_miss_still_give_the_same_tokens(tiny_model)


def _eviction_between_turns_and_a_miss_still_give_the_same_tokens(tiny_model):
    prompt = list(random_prompt(40, seed=7))
    off = Driver(make_engine(tiny_model, total_kv_pages=16))
    on = Driver(_cached_engine(tiny_model, total_kv_pages=16))
    for driver in (off, on):
        driver.run({1: _spec(prompt)})
    assert on.engine.kv_cached_pages() > 0
    assert on.engine.kv_free_pages() == 16  # cache no one uses counts as free
    stale = on.resume_at(_spec(prompt))
    assert stale > 0
    # A big prompt first in the step takes every page: the resume point goes before the
    # cached admission is read, which then misses and is admitted again from 0.
    big = _spec(random_prompt(60, seed=8), max_new_tokens=1)
    for driver in (off, on):
        driver.chunk_size = 64  # big's first chunk: 15 pages of the 16
        driver.run({5: big, 2: _spec(prompt)}, cached={5: 0, 2: stale if driver is on else 0})
    assert on.misses == [2]
    assert on.outputs == off.outputs


def test_preempting_a_sequence_that_shares_pages_leaves_the_others_whole(tiny_model):
    _preempting_a_sequence_that_shares_pages_leaves_the_others_whole(tiny_model)


def _preempting_a_sequence_that_shares_pages_leaves_the_others_whole(tiny_model):
    system = list(random_prompt(16, seed=9))
    specs = {
        i: _spec([*system, *random_prompt(3, seed=30 + i)], max_new_tokens=20) for i in range(3)
    }
    off = Driver(make_engine(tiny_model, total_kv_pages=14))
    on = Driver(_cached_engine(tiny_model, total_kv_pages=14))
    for driver in (off, on):
        driver.run({0: specs[0]})
        driver.run({i: specs[i] for i in (1, 2)})  # these grow until one is preempted
    assert on.outputs == off.outputs
    assert on.preempted and off.preempted
    assert on.cached_tokens >= 2 * 16


def test_a_sequence_that_may_not_use_the_cache_misses_and_is_computed_from_zero(tiny_model):
    prompt = list(random_prompt(30, seed=11))
    on = Driver(_cached_engine(tiny_model))
    on.run({1: _spec(prompt)})
    spec = SequenceSpec(tuple(prompt), 5, use_prefix_cache=False)
    out = on.engine.step([ChunkWork(2, 16, 14, spec, cached_tokens=16)], [])
    assert out.cache_misses == (2,) and 2 not in on.engine.waiting_ids()


def test_cached_tokens_off_the_block_grid_fail_with_a_reason(tiny_model):
    engine = _cached_engine(tiny_model)
    out = engine.step([ChunkWork(1, 5, 5, _spec(random_prompt(20, seed=12)), cached_tokens=5)], [])
    assert "cached_tokens 5" in out.finished[0].error_message


def test_after_everything_ends_and_the_cache_is_cleared_the_pools_are_whole(tiny_model):
    on = Driver(_cached_engine(tiny_model, total_snapshot_slots=4))
    _conversation(on)
    engine = on.engine
    assert engine.kv_cached_pages() > 0 and on.resume_points
    engine.clear_prefix_cache()
    on.sync()
    assert on.resume_points == set()
    assert engine._pages.num_free_pages() == engine.total_kv_pages
    assert engine.prefix_cache.num_snapshots() == 0
    assert engine.gdn_free_slots() == engine.total_gdn_slots


@pytest.mark.slow
def test_every_scenario_gives_the_same_tokens_with_the_cache_on_and_off_in_each_family(family):
    # The fast tests above run them on the dense tiny model; here on each family's
    # transformers-written checkpoint (dense, MoE, Qwen3-Next).
    for scenario in (
        _a_shared_system_prompt_is_computed_once_and_tokens_do_not_change,
        _prompts_diverging_inside_a_block_resume_at_the_block_before,
        _another_adapter_never_resumes_from_the_base_models_blocks,
        _eviction_between_turns_and_a_miss_still_give_the_same_tokens,
        _preempting_a_sequence_that_shares_pages_leaves_the_others_whole,
    ):
        scenario(family.ours)
