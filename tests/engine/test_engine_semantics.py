"""How ModelEngine.step reads a scheduler decision: restarts, ignored ids, finish reasons."""

from __future__ import annotations

from dataclasses import replace

from worker_client.engine.api import ChunkWork, FinishReason, SequenceSpec
from worker_client.engine.config import tiny_config
from worker_client.engine.loading import random_model

from .factories import chunks_for, make_engine, random_prompt, run_to_completion, tokens_of


def test_first_token_is_sampled_with_the_last_prefill_chunk_and_the_sequence_moves_to_running(
    tiny_model,
):
    engine = make_engine(tiny_model)
    spec = SequenceSpec(random_prompt(10, seed=1), max_new_tokens=4)
    out = engine.step([ChunkWork(5, 0, 6, spec)], [])
    assert out.tokens == () and engine.waiting_ids() == [5]
    out = engine.step([ChunkWork(5, 6, 4, None)], [])
    assert len(tokens_of(out, 5)) == 1 and engine.running_ids() == [5]


def test_max_new_tokens_of_one_finishes_right_after_prefill(tiny_model):
    engine = make_engine(tiny_model)
    out = engine.step(
        chunks_for(5, SequenceSpec(random_prompt(10, seed=1), max_new_tokens=1), [10]), []
    )
    assert len(tokens_of(out, 5)) == 1
    assert [(f.seq_id, f.reason, f.generated_tokens) for f in out.finished] == [
        (5, FinishReason.MAX_LENGTH, 1)
    ]
    assert engine.running_ids() == [] and engine.kv_free_pages() == engine.total_kv_pages


def test_stop_token_finishes_with_stop(tiny_model):
    prompt = random_prompt(10, seed=1)
    free_run = run_to_completion(make_engine(tiny_model), 5, SequenceSpec(prompt, max_new_tokens=6))
    spec = SequenceSpec(prompt, max_new_tokens=6, stop_token_ids=(free_run[2],))
    engine = make_engine(tiny_model)
    finished = []
    for chunk in chunks_for(5, spec, [10]):
        finished += engine.step([chunk], []).finished
    while engine.running_ids():
        finished += engine.step([], [5]).finished
    stop_at = free_run.index(free_run[2]) + 1
    assert [(f.reason, f.generated_tokens) for f in finished] == [(FinishReason.STOP, stop_at)]


def test_eos_from_the_config_finishes_with_eos():
    prompt = random_prompt(10, seed=1)
    first_token = run_to_completion(
        make_engine(random_model(tiny_config(), seed=0)), 5, SequenceSpec(prompt, max_new_tokens=1)
    )[0]
    eos_config = replace(tiny_config(), eos_token_ids=(first_token, 3))
    engine = make_engine(random_model(eos_config, seed=0))  # same weights, different EOS
    out = engine.step(chunks_for(5, SequenceSpec(prompt, max_new_tokens=9), [10]), [])
    assert [(f.reason, f.generated_tokens) for f in out.finished] == [(FinishReason.EOS, 1)]


def test_chunk_with_a_spec_for_a_held_id_restarts_it(tiny_model):
    spec = SequenceSpec(random_prompt(12, seed=2), max_new_tokens=5)
    expected = run_to_completion(make_engine(tiny_model), 5, spec)
    engine = make_engine(tiny_model)
    engine.step(chunks_for(5, SequenceSpec(random_prompt(30, seed=3), 50), [30]), [])
    engine.step([], [5])
    assert run_to_completion(engine, 5, spec) == expected
    assert engine.kv_free_pages() == engine.total_kv_pages


def test_unknown_ids_and_empty_chunks_are_ignored(tiny_model):
    engine = make_engine(tiny_model)
    spec = SequenceSpec(random_prompt(12, seed=2), max_new_tokens=5)
    out = engine.step(
        [ChunkWork(7, 3, 4, None), ChunkWork(5, 0, 0, spec), ChunkWork(5, 0, 0, None)], [8, 5]
    )
    assert out.tokens == () and out.finished == () and out.preempted == ()
    assert engine.waiting_ids() == [5] and engine.kv_free_pages() == engine.total_kv_pages


def test_overlapping_chunk_runs_only_its_new_tokens(tiny_model):
    spec = SequenceSpec(random_prompt(12, seed=2), max_new_tokens=5)
    expected = run_to_completion(make_engine(tiny_model), 5, spec)
    engine = make_engine(tiny_model)
    engine.step([ChunkWork(5, 0, 6, spec)], [])
    out = engine.step(
        [ChunkWork(5, 0, 6, None), ChunkWork(5, 3, 9, None)], []
    )  # a retransmission, then 6..12
    generated = tokens_of(out, 5)
    while engine.running_ids():
        generated += tokens_of(engine.step([], [5]), 5)
    assert generated == expected


def test_chunk_starting_past_the_prefilled_tokens_preempts_the_sequence(tiny_model):
    engine = make_engine(tiny_model)
    engine.step([ChunkWork(5, 0, 4, SequenceSpec(random_prompt(12, seed=2), max_new_tokens=5))], [])
    out = engine.step([ChunkWork(5, 8, 4, None)], [])  # chunk 4..8 never arrived
    assert out.preempted == (5,) and out.tokens == ()
    assert engine.waiting_ids() == [] and engine.kv_free_pages() == engine.total_kv_pages
    assert engine.gdn_free_slots() == engine.total_gdn_slots


def test_invalid_prompts_fail_instead_of_raising(tiny_model):
    engine = make_engine(tiny_model)
    out = engine.step(
        [ChunkWork(1, 0, 0, SequenceSpec((), 5)), ChunkWork(2, 0, 2, SequenceSpec((3, 10_000), 5))],
        [],
    )
    assert [(f.seq_id, f.reason) for f in out.finished] == [
        (1, FinishReason.FAILED),
        (2, FinishReason.FAILED),
    ]
    assert engine.gdn_free_slots() == engine.total_gdn_slots


def test_a_prompt_outside_the_vocabulary_fails_before_it_runs_saying_which_token(tiny_model):
    """Regression (outside probe): such a prompt finished FAILED with no reason anywhere."""
    engine = make_engine(tiny_model)
    out = engine.step(
        [ChunkWork(1, 0, 3, SequenceSpec((5, 600, 7), 5)), ChunkWork(2, 0, 0, SequenceSpec((), 5))],
        [],
    )
    assert [(f.seq_id, f.reason, f.error_message) for f in out.finished] == [
        (1, FinishReason.FAILED, "token id 600 is outside the model's vocabulary of 512"),
        (2, FinishReason.FAILED, "the prompt is empty"),
    ]
    assert out.tokens == () and engine.kv_free_pages() == engine.total_kv_pages
