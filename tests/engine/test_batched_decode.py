"""One batched decode forward gives each sequence what it would get decoding alone."""

from __future__ import annotations

import pytest
import torch

from worker_client.engine.api import SequenceSpec
from worker_client.engine.loading import load_model
from worker_client.engine.reference import generate_reference

from .factories import (
    FAMILY_PRESETS,
    PagedPools,
    chunks_for,
    make_engine,
    random_prompt,
    run_to_completion,
    tokens_of,
)
from .tolerance import assert_float64_equal

PROMPT_LENGTHS = (3, 17, 70, 9)


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_batched_decode_logits_equal_each_sequence_decoded_alone_in_float64(preset):
    # Float64 (tolerance.py): rows batched together must not see each other, whatever the host.
    tiny_model = load_model(preset, dtype=torch.float64)
    prompts = [list(random_prompt(n, seed=10 + i)) for i, n in enumerate(PROMPT_LENGTHS)]
    together = PagedPools(tiny_model, num_pages=128, page_size=4, num_slots=4)
    alone = PagedPools(tiny_model, num_pages=128, page_size=4, num_slots=4)
    seq_ids = list(range(len(prompts)))
    slots = [together.state_pool.acquire() for _ in seq_ids]
    alone_slots = [alone.state_pool.acquire() for _ in seq_ids]
    with torch.no_grad():
        for seq_id, prompt in zip(seq_ids, prompts):
            positions = torch.arange(len(prompt))[None]
            for pools, slot in ((together, slots[seq_id]), (alone, alone_slots[seq_id])):
                tiny_model(
                    torch.tensor([prompt]),
                    positions,
                    pools.forward_cache([seq_id], [slot], positions),
                )
        next_ids = [p[-1] for p in prompts]  # any token will do: both sides feed the same
        for _ in range(5):
            positions = torch.tensor([[len(p)] for p in prompts])
            batched = tiny_model(
                torch.tensor([[t] for t in next_ids]),
                positions,
                together.forward_cache(seq_ids, slots, positions),
                last_only=True,
            )
            for seq_id in seq_ids:
                single = tiny_model(
                    torch.tensor([[next_ids[seq_id]]]),
                    positions[seq_id : seq_id + 1],
                    alone.forward_cache(
                        [seq_id], [alone_slots[seq_id]], positions[seq_id : seq_id + 1]
                    ),
                    last_only=True,
                )
                assert_float64_equal(batched[seq_id], single[0])
            next_ids = [int(row.argmax()) for row in batched]
            for prompt, token in zip(prompts, next_ids):
                prompt.append(token)


def test_engine_decoding_several_sequences_together_generates_what_each_generates_alone(tiny_model):
    specs = {
        seq_id: SequenceSpec(random_prompt(n, seed=20 + seq_id), max_new_tokens=6 + seq_id)
        for seq_id, n in enumerate(PROMPT_LENGTHS)
    }
    engine = make_engine(tiny_model)
    generated: dict[int, list[int]] = {seq_id: [] for seq_id in specs}
    for seq_id, spec in specs.items():
        for chunk in chunks_for(seq_id, spec, [len(spec.prompt_token_ids)]):
            generated[seq_id] += tokens_of(engine.step([chunk], []), seq_id)
    while engine.running_ids():
        out = engine.step([], engine.running_ids())
        for seq_id in specs:
            generated[seq_id] += tokens_of(out, seq_id)
    assert engine.kv_free_pages() == engine.total_kv_pages
    for seq_id, spec in specs.items():
        alone = run_to_completion(make_engine(tiny_model), seq_id, spec)
        reference = generate_reference(tiny_model, spec.prompt_token_ids, spec.max_new_tokens)
        assert generated[seq_id] == alone == list(reference.token_ids)


def test_decode_batch_split_by_max_batch_size_generates_the_same_tokens(tiny_model):
    specs = {
        seq_id: SequenceSpec(random_prompt(5 + 3 * seq_id, seed=30 + seq_id), max_new_tokens=4)
        for seq_id in range(5)
    }
    outputs = []
    for max_batch_size in (None, 2):
        engine = make_engine(tiny_model, max_batch_size=max_batch_size)
        engine.step(
            [
                c
                for s, spec in specs.items()
                for c in chunks_for(s, spec, [len(spec.prompt_token_ids)])
            ],
            [],
        )
        steps = []
        while engine.running_ids():
            steps.append(engine.step([], engine.running_ids()).tokens)
        outputs.append(steps)
    assert outputs[0] == outputs[1]
