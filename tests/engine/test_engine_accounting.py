"""Pages and slots: taken as sequences grow, all returned on finish, evict and preemption."""

from __future__ import annotations

from worker_client.engine.api import ChunkWork, FinishReason, SequenceSpec

from .factories import chunks_for, make_engine, random_prompt


def prefill(engine, seq_id: int, spec: SequenceSpec):
    return engine.step(chunks_for(seq_id, spec, [len(spec.prompt_token_ids)]), [])


def assert_all_free(engine) -> None:
    assert engine.kv_free_pages() == engine.total_kv_pages
    assert engine.gdn_free_slots() == engine.total_gdn_slots
    assert engine.waiting_ids() == [] and engine.running_ids() == []


def test_pages_grow_on_demand_and_all_return_when_sequences_finish(tiny_model):
    engine = make_engine(tiny_model, total_kv_pages=32, page_size=4, total_gdn_slots=3)
    specs = {s: SequenceSpec(random_prompt(6 + s, seed=s), max_new_tokens=5) for s in range(3)}
    engine.step([ChunkWork(0, 0, 3, specs[0])], [])
    assert engine.kv_free_pages() == 31 and engine.gdn_free_slots() == 2
    assert engine.waiting_ids() == [0]
    engine.step(
        [ChunkWork(0, 3, 3, None), *chunks_for(1, specs[1], [7]), *chunks_for(2, specs[2], [8])], []
    )
    assert engine.running_ids() == [0, 1, 2] and engine.gdn_free_slots() == 0
    assert engine.kv_free_pages() == 32 - (2 + 2 + 2)
    finished = []
    while engine.running_ids():
        finished += engine.step([], engine.running_ids()).finished
    assert sorted(f.seq_id for f in finished) == [0, 1, 2]
    assert all(f.reason is FinishReason.MAX_LENGTH and f.generated_tokens == 5 for f in finished)
    assert_all_free(engine)


def test_evict_frees_pages_and_slot_and_ignores_unknown_ids(tiny_model):
    engine = make_engine(tiny_model, total_kv_pages=16, page_size=4, total_gdn_slots=2)
    prefill(engine, 1, SequenceSpec(random_prompt(9, seed=1), max_new_tokens=50))
    engine.step([ChunkWork(2, 0, 5, SequenceSpec(random_prompt(12, seed=2), 50))], [])
    assert engine.running_ids() == [1] and engine.waiting_ids() == [2]
    engine.evict([2, 1, 99])
    assert_all_free(engine)


def test_out_of_pages_preempts_the_latest_admitted_and_reports_it(tiny_model):
    # 10 pages of 4 tokens; two 16-token prompts take 4 pages each.
    engine = make_engine(tiny_model, total_kv_pages=10, page_size=4, total_gdn_slots=2)
    for seq_id in (1, 2):
        prefill(engine, seq_id, SequenceSpec(random_prompt(16, seed=seq_id), max_new_tokens=30))
    out = engine.step([], [1, 2])  # positions 16: one new page each
    assert out.preempted == () and engine.kv_free_pages() == 0
    preempted = []
    for _ in range(4):  # position 20 needs a fifth page each: only one can have it
        preempted += engine.step([], engine.running_ids()).preempted
    assert preempted == [2]
    assert engine.running_ids() == [1]
    assert engine.kv_free_pages() == 10 - 6 and engine.gdn_free_slots() == 1


def test_prefill_that_finds_no_page_preempts_itself_when_it_is_the_latest(tiny_model):
    engine = make_engine(tiny_model, total_kv_pages=6, page_size=4, total_gdn_slots=2)
    prefill(engine, 1, SequenceSpec(random_prompt(16, seed=1), max_new_tokens=30))
    out = prefill(engine, 2, SequenceSpec(random_prompt(12, seed=2), max_new_tokens=30))
    assert out.preempted == (2,) and out.tokens == ()
    assert engine.running_ids() == [1]
    assert engine.kv_free_pages() == 2 and engine.gdn_free_slots() == 1


def test_first_chunk_without_a_free_gdn_slot_is_preempted(tiny_model):
    engine = make_engine(tiny_model, total_gdn_slots=1)
    prefill(engine, 1, SequenceSpec(random_prompt(5, seed=1), max_new_tokens=30))
    out = prefill(engine, 2, SequenceSpec(random_prompt(5, seed=2), max_new_tokens=30))
    assert out.preempted == (2,)
    assert engine.running_ids() == [1] and engine.gdn_free_slots() == 0


def test_sequence_larger_than_the_whole_pool_fails_and_frees_everything(tiny_model):
    engine = make_engine(tiny_model, total_kv_pages=3, page_size=4, total_gdn_slots=2)
    out = prefill(engine, 1, SequenceSpec(random_prompt(13, seed=1), max_new_tokens=3))
    assert [(f.seq_id, f.reason) for f in out.finished] == [(1, FinishReason.FAILED)]
    assert (
        out.finished[0].error_message
        == "the sequence needs 4 KV pages of 4 tokens, more than the worker's 3 in all"
    )
    assert_all_free(engine)
