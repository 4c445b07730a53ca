"""Batched prefill: chunks of different sequences run in one packed forward, with the
logits (float64) and greedy tokens (float32) of one forward per chunk."""

from __future__ import annotations

import pytest
import torch

from worker_client.engine.api import ChunkWork, FinishReason, SequenceSpec
from worker_client.engine.batch import PackedBatch
from worker_client.engine.loading import load_model
from worker_client.engine.reference import generate_reference

from .factories import FAMILY_PRESETS, PagedPools, chunks_for, make_engine, random_prompt, tokens_of
from .tolerance import assert_float64_equal

# (tokens already prefilled, tokens in this step's chunk) per sequence: fresh and continuing
# rows, single tokens, and chunks across the GDN chunk size (64).
ROWS = ((0, 5), (7, 64), (0, 1), (3, 70), (65, 17), (0, 9))


def test_packed_batch_pads_and_unpads_rows_of_different_lengths():
    batch = PackedBatch([2, 3, 1], torch.tensor([4, 5, 0, 1, 2, 9]))
    packed = torch.arange(6).float()[:, None]
    padded = batch.pad(packed)
    assert padded[..., 0].tolist() == [[0, 1, 0], [2, 3, 4], [5, 0, 0]]
    assert torch.equal(batch.unpad(padded), packed)
    assert batch.last_tokens(packed)[:, 0].tolist() == [1, 4, 5]
    assert batch.padded_positions.tolist() == [[4, 5, 0], [0, 1, 2], [9, 0, 0]]
    assert batch.row_of_token.tolist() == [0, 0, 1, 1, 1, 2]


def test_packed_batch_refuses_empty_rows_and_mismatched_positions():
    with pytest.raises(ValueError, match="at least one token"):
        PackedBatch([2, 0], torch.arange(2))
    with pytest.raises(ValueError, match="do not match"):
        PackedBatch([2, 2], torch.arange(3))


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_packed_forward_of_rows_of_different_lengths_equals_each_row_alone_in_float64(preset):
    model = load_model(preset, dtype=torch.float64)
    prompts = [list(random_prompt(done + new, seed=40 + i)) for i, (done, new) in enumerate(ROWS)]
    packed_pools = PagedPools(model, num_pages=256, page_size=4, num_slots=len(ROWS))
    alone_pools = PagedPools(model, num_pages=256, page_size=4, num_slots=len(ROWS))
    seq_ids = list(range(len(ROWS)))
    slots = [packed_pools.state_pool.acquire() for _ in seq_ids]
    alone_slots = [alone_pools.state_pool.acquire() for _ in seq_ids]
    expected = []
    with torch.no_grad():
        for seq_id, (done, new) in enumerate(ROWS):
            prompt = prompts[seq_id]
            if done:  # the same earlier chunk on both sides
                positions = torch.arange(done)[None]
                for pools, slot in (
                    (packed_pools, slots[seq_id]),
                    (alone_pools, alone_slots[seq_id]),
                ):
                    model(
                        torch.tensor([prompt[:done]]),
                        positions,
                        pools.forward_cache([seq_id], [slot], positions),
                    )
            positions = torch.arange(done, done + new)[None]
            cache = alone_pools.forward_cache([seq_id], [alone_slots[seq_id]], positions)
            expected.append(model(torch.tensor([prompt[done:]]), positions, cache)[0])
        batch = PackedBatch(
            [new for _, new in ROWS], torch.cat([torch.arange(d, d + n) for d, n in ROWS])
        )
        token_ids = torch.tensor(
            [t for prompt, (done, _) in zip(prompts, ROWS) for t in prompt[done:]]
        )
        packed = model.forward_packed(
            token_ids, batch, packed_pools.packed_cache(seq_ids, slots, batch)
        )
        assert_float64_equal(packed, torch.cat(expected))
        # The states left behind are the same too: one more decode step agrees.
        positions = torch.tensor([[done + new] for done, new in ROWS])
        next_ids = torch.tensor([[p[-1]] for p in prompts])
        together = model(
            next_ids,
            positions,
            packed_pools.forward_cache(seq_ids, slots, positions),
            last_only=True,
        )
        for seq_id in seq_ids:
            row = positions[seq_id : seq_id + 1]
            cache = alone_pools.forward_cache([seq_id], [alone_slots[seq_id]], row)
            assert_float64_equal(
                together[seq_id],
                model(next_ids[seq_id : seq_id + 1], row, cache, last_only=True)[0],
            )


def prefill_schedule(specs: dict[int, SequenceSpec], chunk_size: int) -> list[list[ChunkWork]]:
    """Steps as a scheduler sends them: one chunk of up to `chunk_size` of every unfinished prompt."""
    steps, starts = [], dict.fromkeys(specs, 0)
    while any(starts[s] < len(spec.prompt_token_ids) for s, spec in specs.items()):
        step = []
        for seq_id, spec in specs.items():
            start, length = starts[seq_id], len(spec.prompt_token_ids)
            if start < length:
                step.append(
                    ChunkWork(
                        seq_id, start, min(chunk_size, length - start), spec if start == 0 else None
                    )
                )
                starts[seq_id] = start + step[-1].chunk_len
        steps.append(step)
    return steps


def generate_all(engine, specs: dict[int, SequenceSpec], chunk_size: int) -> dict[int, list[int]]:
    generated: dict[int, list[int]] = {seq_id: [] for seq_id in specs}
    for step in prefill_schedule(specs, chunk_size):
        out = engine.step(step, engine.running_ids())
        for seq_id, ids in out.tokens:
            generated[seq_id] += ids
    while engine.running_ids():
        for seq_id, ids in engine.step([], engine.running_ids()).tokens:
            generated[seq_id] += ids
    return generated


class ForwardCounter:
    """Counts the model's packed forwards and the rows of each."""

    def __init__(self, model, monkeypatch) -> None:
        self.rows: list[int] = []
        original = model.forward_packed

        def counted(token_ids, batch, *args, **kwargs):
            self.rows.append(batch.num_rows)
            return original(token_ids, batch, *args, **kwargs)

        monkeypatch.setattr(model, "forward_packed", counted)


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_engine_packing_a_steps_chunks_generates_what_one_forward_per_chunk_generates(preset):
    model = load_model(preset)
    lengths = (3, 40, 17, 90, 1, 64, 33, 8)
    specs = {
        seq_id: SequenceSpec(random_prompt(n, seed=60 + seq_id), max_new_tokens=5)
        for seq_id, n in enumerate(lengths)
    }
    packed = generate_all(make_engine(model, total_gdn_slots=8), specs, chunk_size=32)
    one_by_one = generate_all(
        make_engine(model, total_gdn_slots=8, max_prefill_sequences=1), specs, chunk_size=32
    )
    assert packed == one_by_one and all(len(tokens) == 5 for tokens in packed.values())


def test_a_steps_prefill_chunks_run_in_one_forward_or_groups_of_max_prefill_sequences(
    tiny_model, monkeypatch
):
    counter = ForwardCounter(tiny_model, monkeypatch)
    specs = {
        seq_id: SequenceSpec(random_prompt(5 + seq_id, seed=seq_id), max_new_tokens=3)
        for seq_id in range(5)
    }
    chunks = [
        c
        for seq_id, spec in specs.items()
        for c in chunks_for(seq_id, spec, [len(spec.prompt_token_ids)])
    ]
    make_engine(tiny_model).step(chunks, [])
    assert counter.rows == [5]
    counter.rows.clear()
    make_engine(tiny_model, max_prefill_sequences=2).step(chunks, [])
    assert counter.rows == [2, 2, 1]


def test_a_packed_prefill_forward_stays_within_max_prefill_tokens_padded(tiny_model, monkeypatch):
    counter = ForwardCounter(tiny_model, monkeypatch)
    lengths = (10, 30, 20, 5, 64, 3)
    specs = {
        seq_id: SequenceSpec(random_prompt(n, seed=seq_id), max_new_tokens=3)
        for seq_id, n in enumerate(lengths)
    }
    chunks = [
        c
        for seq_id, spec in specs.items()
        for c in chunks_for(seq_id, spec, [len(spec.prompt_token_ids)])
    ]
    engine = make_engine(tiny_model, max_prefill_tokens=64)
    out = engine.step(chunks, [])
    # Rows x longest row <= 64: [10, 30] (60), [20, 5] (40), [64] alone, [3].
    assert counter.rows == [2, 2, 1, 1] and len(out.tokens) == 6


def test_two_chunks_of_one_sequence_in_a_step_run_as_one_row(tiny_model, monkeypatch):
    spec = SequenceSpec(random_prompt(12, seed=3), max_new_tokens=4)
    expected = tokens_of(make_engine(tiny_model).step(chunks_for(7, spec, [12]), []), 7)
    counter = ForwardCounter(tiny_model, monkeypatch)
    engine = make_engine(tiny_model)
    out = engine.step(
        [ChunkWork(7, 0, 5, spec), ChunkWork(7, 5, 7, None), ChunkWork(7, 2, 4, None)], []
    )
    assert counter.rows == [1] and tokens_of(out, 7) == expected and engine.running_ids() == [7]


def test_a_sequence_preempted_by_a_later_chunk_of_the_step_runs_nothing(tiny_model):
    # 6 pages of 4 tokens: sequence 1 takes 3, sequence 2 (admitted later) takes 2, then
    # sequence 1's next chunk needs 2 more and preempts sequence 2, the latest admitted.
    engine = make_engine(tiny_model, total_kv_pages=6, page_size=4, total_gdn_slots=2)
    first = SequenceSpec(random_prompt(20, seed=1), max_new_tokens=3)
    second = SequenceSpec(random_prompt(8, seed=2), max_new_tokens=3)
    out = engine.step(
        [ChunkWork(1, 0, 12, first), ChunkWork(2, 0, 8, second), ChunkWork(1, 12, 8, None)], []
    )
    assert out.preempted == (2,) and tokens_of(out, 2) == []
    assert len(tokens_of(out, 1)) == 1 and engine.running_ids() == [1]
    assert engine.kv_free_pages() == 1 and engine.gdn_free_slots() == 1
    rest = tokens_of(out, 1)
    while engine.running_ids():
        rest += tokens_of(engine.step([], [1]), 1)
    assert rest == list(generate_reference(tiny_model, first.prompt_token_ids, 3).token_ids)


def test_a_restart_in_the_same_step_drops_the_old_chunk(tiny_model):
    old, new = (SequenceSpec(random_prompt(n, seed=n), max_new_tokens=2) for n in (9, 6))
    engine = make_engine(tiny_model)
    out = engine.step([ChunkWork(4, 0, 5, old), ChunkWork(4, 0, 6, new)], [])
    assert (
        tokens_of(out, 4)
        == list(generate_reference(tiny_model, new.prompt_token_ids, 2).token_ids)[:1]
    )
    assert [f.reason for f in out.finished] == [] and engine.running_ids() == [4]
    assert FinishReason.MAX_LENGTH in [f.reason for f in engine.step([], [4]).finished]
