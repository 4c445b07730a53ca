"""A sequence prefilled on one engine, exported, imported into another and decoded there
gives the greedy tokens it gives decoded where it was prefilled (and the sequential
reference's): the handoff of docs/disaggregation.md at the engine level."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from worker_client.engine.api import (
    ChunkWork,
    ImportProblem,
    ImportRefused,
    SequenceSpec,
    StateKind,
)
from worker_client.engine.loading import load_model
from worker_client.engine.reference import generate_reference

from .factories import make_engine, random_prompt, run_to_completion, tokens_of
from .test_prefix_cache import BLOCK

NUM_NEW = 12


@pytest.fixture(scope="module", params=["tiny", "tiny-next"])
def model(request):
    return load_model(request.param, device="cpu", dtype=torch.float32, seed=0)


def _prefill_first_token(engine, seq_id: int, spec: SequenceSpec) -> int:
    out = engine.step([ChunkWork(seq_id, 0, len(spec.prompt_token_ids), spec)], [])
    (token,) = tokens_of(out, seq_id)
    return token


def _decode_all(engine, seq_id: int) -> list[int]:
    generated = []
    while seq_id in engine.running_ids():
        generated += tokens_of(engine.step([], [seq_id]), seq_id)
    return generated


def _handed_off_spec(spec: SequenceSpec, first: int) -> SequenceSpec:
    """The receiver's spec: the prompt and the first token, one token fewer to generate."""
    return dataclasses.replace(
        spec,
        prompt_token_ids=(*spec.prompt_token_ids, first),
        max_new_tokens=spec.max_new_tokens - 1,
    )


@pytest.mark.slow  # the sequential reference re-runs the whole sequence per token
def test_decoding_after_a_handoff_matches_decoding_where_prefilled(model):
    spec = SequenceSpec(random_prompt(37, seed=3), max_new_tokens=NUM_NEW, ignore_eos=True)
    alone = run_to_completion(make_engine(model), 1, spec)

    sender, receiver = make_engine(model), make_engine(model)
    first = _prefill_first_token(sender, 1, spec)
    chunks = sender.export_sequence(1)
    assert chunks is not None
    receiver.import_sequence(7, _handed_off_spec(spec, first), chunks)
    assert receiver.running_ids() == [7]
    handed_off = [first, *_decode_all(receiver, 7)]

    assert handed_off == alone
    reference = generate_reference(model, spec.prompt_token_ids, NUM_NEW)
    assert handed_off == list(reference.token_ids)
    # The sender still holds its copy, unchanged (it serves it until evicted).
    assert sender.running_ids() == [1]


def test_the_small_preset_hands_off_exactly_and_registers_its_larger_sizes():
    # The benchmarks' preset (bench/disagg.py: hidden 512, 2 attention + 6 GDN layers).
    small, tiny = load_model("small"), load_model("tiny")
    spec = SequenceSpec(random_prompt(29, seed=8), max_new_tokens=6, ignore_eos=True)
    alone = run_to_completion(make_engine(small), 1, spec)

    sender, receiver = make_engine(small), make_engine(small)
    first = _prefill_first_token(sender, 1, spec)
    chunks = sender.export_sequence(1)
    receiver.import_sequence(7, _handed_off_spec(spec, first), chunks)
    assert [first, *_decode_all(receiver, 7)] == alone

    kv = sum(len(c.data) for c in chunks if c.kind is StateKind.ATTENTION_KV)
    assert kv == sender.handoff_bytes_per_token * 29
    assert sum(len(c.data) for c in chunks) - kv == sender.handoff_fixed_bytes
    # fp32: 2 attention layers x (K + V) x 2 heads x 64; 6 GDN layers x (8 heads x 64 x 64
    # recurrent + 1,024 channels x 3 convolution columns), against tiny's 1 and 3 smaller.
    assert sender.handoff_bytes_per_token == 2 * 2 * 2 * 64 * 4
    assert sender.handoff_fixed_bytes == 6 * (8 * 64 * 64 + 1024 * 3) * 4
    tiny_engine = make_engine(tiny)
    assert sender.handoff_bytes_per_token == 8 * tiny_engine.handoff_bytes_per_token
    assert sender.handoff_fixed_bytes > 50 * tiny_engine.handoff_fixed_bytes


def test_export_carries_every_attention_position_and_gdn_layer(model):
    spec = SequenceSpec(random_prompt(21, seed=4), max_new_tokens=4)
    engine = make_engine(model)
    _prefill_first_token(engine, 1, spec)
    chunks = engine.export_sequence(1, first_token=8)
    config = model.config
    kv = [c for c in chunks if c.kind is StateKind.ATTENTION_KV]
    assert {c.layer for c in kv} == set(range(config.num_full_attention_layers))
    assert all(c.first_token == 8 and c.num_tokens == 21 - 8 for c in kv)
    for kind in (StateKind.GDN_RECURRENT, StateKind.GDN_CONV):
        layers = [c.layer for c in chunks if c.kind is kind]
        assert layers == list(range(config.num_linear_attention_layers))
    assert engine.export_sequence(99) is None


def test_the_registered_handoff_sizes_are_what_an_export_moves(model):
    engine = make_engine(model)
    for seq_id, prompt_len in ((1, 21), (2, 40)):
        spec = SequenceSpec(random_prompt(prompt_len, seed=seq_id), max_new_tokens=4)
        _prefill_first_token(engine, seq_id, spec)
        chunks = engine.export_sequence(seq_id)
        kv = sum(len(c.data) for c in chunks if c.kind is StateKind.ATTENTION_KV)
        assert kv == engine.handoff_bytes_per_token * prompt_len
        assert sum(len(c.data) for c in chunks) - kv == engine.handoff_fixed_bytes
    assert engine.handoff_fixed_bytes > 0  # a hybrid model: GDN states travel too


def test_a_receiver_with_the_prefix_cached_fetches_only_the_rest(model):
    shared = random_prompt(2 * BLOCK, seed=5)
    spec = SequenceSpec((*shared, *random_prompt(13, seed=6)), NUM_NEW, ignore_eos=True)
    alone = run_to_completion(make_engine(model), 1, spec)

    cache = dict(cache_block_tokens=BLOCK, total_snapshot_slots=8)
    receiver = make_engine(model, **cache)
    # Another sequence with the same first two blocks leaves them cached on the receiver.
    other = SequenceSpec((*shared, *random_prompt(5, seed=7)), max_new_tokens=2)
    run_to_completion(receiver, 2, other, [BLOCK, BLOCK, 5])
    free_before = receiver.kv_free_pages()

    sender = make_engine(model)
    first = _prefill_first_token(sender, 1, spec)
    chunks = sender.export_sequence(1, first_token=2 * BLOCK)
    receiver.import_sequence(7, _handed_off_spec(spec, first), chunks, cached_tokens=2 * BLOCK)

    assert receiver.prefix_cache.num_resumes == 1
    # Only the pages past the cached blocks were taken (the cached ones count as free).
    page_size = receiver.page_size
    own_pages = -(-(len(spec.prompt_token_ids) - 2 * BLOCK) // page_size)
    cached_pages = 2 * BLOCK // page_size
    assert free_before - receiver.kv_free_pages() == own_pages + cached_pages
    assert [first, *_decode_all(receiver, 7)] == alone


def test_an_import_with_a_corrupted_or_missing_chunk_is_refused_and_holds_nothing(model):
    spec = SequenceSpec(random_prompt(17, seed=8), max_new_tokens=4)
    sender, receiver = make_engine(model), make_engine(model)
    first = _prefill_first_token(sender, 1, spec)
    chunks = list(sender.export_sequence(1))
    pages, slots = receiver.kv_free_pages(), receiver.gdn_free_slots()
    spec_b = _handed_off_spec(spec, first)
    truncated = [dataclasses.replace(chunks[0], data=chunks[0].data[:-4]), *chunks[1:]]
    for bad in (chunks[1:], truncated, [*chunks, chunks[-1]]):
        with pytest.raises(ImportRefused) as refused:
            receiver.import_sequence(7, spec_b, bad)
        assert refused.value.problem is ImportProblem.MALFORMED
        assert receiver.running_ids() == []
        assert (receiver.kv_free_pages(), receiver.gdn_free_slots()) == (pages, slots)


def test_an_import_without_room_is_refused_without_preempting(model):
    spec = SequenceSpec(random_prompt(30, seed=9), max_new_tokens=4)
    sender = make_engine(model)
    first = _prefill_first_token(sender, 1, spec)
    receiver = make_engine(model, total_kv_pages=8, total_gdn_slots=2)
    held = SequenceSpec(random_prompt(20, seed=10), max_new_tokens=50, ignore_eos=True)
    _prefill_first_token(receiver, 2, held)
    with pytest.raises(ImportRefused) as refused:
        receiver.import_sequence(7, _handed_off_spec(spec, first), sender.export_sequence(1))
    assert refused.value.problem is ImportProblem.NO_ROOM
    assert receiver.running_ids() == [2]

    cached = make_engine(model, cache_block_tokens=BLOCK, total_snapshot_slots=4)
    with pytest.raises(ImportRefused) as refused:
        cached.import_sequence(
            7, _handed_off_spec(spec, first), sender.export_sequence(1, BLOCK), BLOCK
        )
    assert refused.value.problem is ImportProblem.CACHE_MISS
    assert cached.running_ids() == [] and cached.gdn_free_slots() == cached.total_gdn_slots


def test_an_import_of_a_sequence_held_already_is_refused_and_leaves_it_held(model):
    spec = SequenceSpec(random_prompt(17, seed=11), max_new_tokens=4)
    sender, receiver = make_engine(model), make_engine(model)
    first = _prefill_first_token(sender, 1, spec)
    chunks = sender.export_sequence(1)
    receiver.import_sequence(7, _handed_off_spec(spec, first), chunks)
    pages, slots = receiver.kv_free_pages(), receiver.gdn_free_slots()
    with pytest.raises(ImportRefused) as refused:
        receiver.import_sequence(7, _handed_off_spec(spec, first), chunks)
    assert refused.value.problem is ImportProblem.INVALID
    assert receiver.running_ids() == [7]
    assert (receiver.kv_free_pages(), receiver.gdn_free_slots()) == (pages, slots)
    assert receiver.export_sequence(7) is not None  # its state still there


def test_an_import_whose_state_write_fails_gives_back_its_pages_and_slot(model, monkeypatch):
    import worker_client.engine.engine as engine_module

    spec = SequenceSpec(random_prompt(17, seed=12), max_new_tokens=4)
    sender, receiver = make_engine(model), make_engine(model)
    first = _prefill_first_token(sender, 1, spec)
    pages, slots = receiver.kv_free_pages(), receiver.gdn_free_slots()

    def failing_write(*args, **kwargs):
        raise RuntimeError("device write failed")

    monkeypatch.setattr(engine_module, "write_state", failing_write)
    with pytest.raises(RuntimeError):
        receiver.import_sequence(7, _handed_off_spec(spec, first), sender.export_sequence(1))
    assert receiver.running_ids() == []
    assert (receiver.kv_free_pages(), receiver.gdn_free_slots()) == (pages, slots)
