"""SimEngine keeps the reference engine's books: pages, slots, chunks, tokens, preemption."""

from __future__ import annotations

import dataclasses

import pytest

from tests.sim.factories import LinearCost, chunk, first_chunk, sim_engine
from worker_client.engine.api import FinishReason


def test_a_chunk_takes_a_slot_and_the_pages_its_tokens_need():
    engine = sim_engine(total_kv_pages=10, page_size=4, total_gdn_slots=3)
    out = engine.step([first_chunk(1, prompt_len=10, chunk_len=5, max_new_tokens=3)], [])
    assert out.tokens == () and out.preempted == ()
    assert engine.gdn_free_slots() == 2
    assert engine.kv_free_pages() == 10 - 2  # 5 tokens in pages of 4
    assert engine.waiting_ids() == [1] and engine.running_ids() == []


def test_the_last_chunk_samples_the_first_token_and_decodes_add_one_token_each():
    engine = sim_engine(total_kv_pages=10, page_size=4)
    engine.step([first_chunk(1, prompt_len=6, chunk_len=4, max_new_tokens=3)], [])
    out = engine.step([chunk(1, 4, 4)], [])  # overlaps the prompt's end: only 2 new tokens
    assert [s for s, _ in out.tokens] == [1]
    assert engine.running_ids() == [1] and engine.kv_free_pages() == 10 - 2
    out = engine.step([], [1])  # feeds token 1 at position 6: 7 positions, still 2 pages
    assert len(out.tokens) == 1 and engine.kv_free_pages() == 8
    out = engine.step([], [1])  # 3rd token: max_new_tokens reached, all freed
    assert out.finished[0].reason is FinishReason.MAX_LENGTH
    assert out.finished[0].generated_tokens == 3
    assert engine.kv_free_pages() == 10 and engine.gdn_free_slots() == 8
    assert engine.running_ids() == []


def test_a_decode_crossing_a_page_boundary_takes_one_page():
    engine = sim_engine(total_kv_pages=10, page_size=4)
    engine.step([first_chunk(1, prompt_len=4, chunk_len=4, max_new_tokens=10)], [])
    assert engine.kv_free_pages() == 9
    engine.step([], [1])  # position 4: a second page
    assert engine.kv_free_pages() == 8


def test_when_pages_run_out_the_latest_admitted_holding_pages_is_preempted():
    engine = sim_engine(total_kv_pages=4, page_size=4)
    engine.step([first_chunk(1, 8, 8, 10), first_chunk(2, 8, 8, 10)], [])
    assert engine.kv_free_pages() == 0 and engine.running_ids() == [1, 2]
    out = engine.step([], [1, 2])  # seq 1 needs a page: seq 2 (latest) gives its two back
    assert out.preempted == (2,)
    assert [s for s, _ in out.tokens] == [1]
    assert engine.running_ids() == [1] and engine.kv_free_pages() == 1


def test_a_growing_sequence_that_is_itself_the_latest_admitted_is_preempted():
    engine = sim_engine(total_kv_pages=3, page_size=4)
    engine.step([first_chunk(1, 8, 8, 10), first_chunk(2, 12, 4, 10)], [])
    out = engine.step([chunk(2, 4, 8)], [])  # needs 2 more pages, 0 free: 2 is the latest
    assert out.preempted == (2,)
    assert engine.waiting_ids() == [] and engine.kv_free_pages() == 1


def test_a_first_chunk_without_a_free_slot_is_preempted():
    engine = sim_engine(total_gdn_slots=1)
    out = engine.step([first_chunk(1, 4, 4, 2), first_chunk(2, 4, 4, 2)], [])
    assert out.preempted == (2,)
    assert engine.gdn_free_slots() == 0


def test_a_chunk_starting_past_the_cursor_preempts_the_sequence():
    engine = sim_engine()
    engine.step([first_chunk(1, 12, 4, 2)], [])
    out = engine.step([chunk(1, 8, 4)], [])  # the chunk [4, 8) was lost
    assert out.preempted == (1,)
    assert engine.waiting_ids() == [] and engine.kv_free_pages() == 64


def test_a_sequence_larger_than_the_whole_pool_fails():
    engine = sim_engine(total_kv_pages=2, page_size=4)
    out = engine.step([first_chunk(1, 12, 12, 2)], [])
    assert out.finished[0].reason is FinishReason.FAILED
    assert engine.kv_free_pages() == 2 and engine.gdn_free_slots() == 8


def test_evict_frees_pages_and_slot_and_ignores_unknown_ids():
    engine = sim_engine(total_kv_pages=8, page_size=4, total_gdn_slots=2)
    engine.step([first_chunk(1, 8, 8, 5)], [])
    engine.evict([1, 99])
    assert engine.kv_free_pages() == 8 and engine.gdn_free_slots() == 2
    assert engine.running_ids() == []


def test_a_readmission_with_a_resume_spec_restarts_from_token_zero():
    engine = sim_engine(total_kv_pages=8, page_size=4)
    engine.step([first_chunk(1, 4, 4, 5)], [])
    engine.step([], [1])
    out = engine.step([first_chunk(1, 6, 6, 3)], [])  # prompt + 2 generated, 3 left
    assert engine.num_held_pages(1) == 2 and [s for s, _ in out.tokens] == [1]


def test_the_cost_model_sees_the_work_actually_done():
    cost = LinearCost()
    engine = sim_engine(total_kv_pages=16, page_size=4, cost=cost)
    engine.step([first_chunk(1, 10, 6, 4)], [])
    engine.step([chunk(1, 6, 6)], [])  # only 4 tokens left of the prompt
    engine.step([first_chunk(2, 3, 3, 4)], [1])
    assert cost.loads[0].prefill_chunks == ((6, 0),)
    assert cost.loads[1].prefill_chunks == ((4, 6),)
    assert cost.loads[2].prefill_chunks == ((3, 0),)
    assert cost.loads[2].decode_context_lens == (10,)  # 10 prompt tokens cached
    assert engine.last_step_seconds == pytest.approx(0.01 + 0.0001 * 4)


@pytest.mark.slow
def test_sim_engine_keeps_the_same_books_as_the_reference_engine():
    """The same decisions to ModelEngine (tiny model, no EOS) and SimEngine: the same free
    pages and slots, waiting and running ids, finishes and preemptions after every step."""
    torch = pytest.importorskip("torch")
    from worker_client.engine.config import tiny_config
    from worker_client.engine.engine import ModelEngine
    from worker_client.engine.loading import random_model

    model = random_model(dataclasses.replace(tiny_config(), eos_token_ids=()), seed=0).eval()
    reference = ModelEngine(model, total_kv_pages=6, page_size=4, total_gdn_slots=3, device="cpu")
    sim = sim_engine(total_kv_pages=6, page_size=4, total_gdn_slots=3)
    steps = [
        ([first_chunk(1, 7, 4, 5), first_chunk(2, 3, 3, 6)], []),
        ([chunk(1, 4, 4), first_chunk(3, 5, 5, 2), first_chunk(4, 2, 2, 2)], [2]),
        ([], [1, 2, 3]),
        ([], [1, 2, 3]),
        ([first_chunk(5, 9, 8, 3)], [1, 2]),
        ([chunk(5, 8, 4)], [1, 2]),
        ([first_chunk(13, 6, 3, 2), chunk(13, 3, 3)], []),  # two chunks of one prompt, packed
        ([], [13]),
        ([], [1, 2, 5]),
        ([chunk(3, 0, 0), first_chunk(6, 30, 30, 1)], [1, 2, 5]),
        ([], [1, 2, 5]),
        ([first_chunk(7, 8, 8, 9), first_chunk(8, 8, 8, 9), first_chunk(9, 7, 7, 9)], []),
        ([], [7, 8, 9]),  # 7 needs a page: 9, the latest admitted, gives its pages back
        ([], [7, 8]),
        ([], [7, 8]),
        ([first_chunk(10, 9, 4, 3), chunk(10, 4, 5)], [7]),  # two chunks of one sequence
        ([first_chunk(11, 4, 4, 2), first_chunk(12, 4, 4, 2)], [10]),
    ]
    with torch.inference_mode():
        for n, (prefill, decode) in enumerate(steps):
            expected, got = reference.step(prefill, decode), sim.step(prefill, decode)
            assert got.preempted == expected.preempted, n
            assert got.finished == expected.finished, n
            assert [s for s, _ in got.tokens] == [s for s, _ in expected.tokens], n
            assert sim.kv_free_pages() == reference.kv_free_pages(), n
            assert sim.gdn_free_slots() == reference.gdn_free_slots(), n
            assert sim.waiting_ids() == reference.waiting_ids(), n
            assert sim.running_ids() == reference.running_ids(), n
