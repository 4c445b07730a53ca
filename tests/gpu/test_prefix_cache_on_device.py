"""The prefix cache on the device: GDN snapshots copied out of a sequence's slot and into
another's there give the tokens of computing the prompt from token 0.

The CPU suite's scenarios (tests/engine/test_prefix_cache.py) run as they are with the
model and the engine on the device, and a resume is checked to be bitwise the cold
computation where both do the same arithmetic, in float32 and in bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine import test_prefix_cache as cpu_suite
from tests.engine.factories import make_engine, random_prompt
from worker_client.engine.api import SequenceSpec
from worker_client.engine.loading import load_model

from .device import DEVICE, ON_DEVICE, assert_bitwise_equal, generate, report

pytestmark = ON_DEVICE

BLOCK = cpu_suite.BLOCK  # 8 tokens: two pages of 4


@pytest.fixture(scope="module")
def device_model():
    return load_model("tiny", device=DEVICE, dtype=torch.float32)


@pytest.mark.parametrize(
    "scenario",
    [
        cpu_suite._a_shared_system_prompt_is_computed_once_and_tokens_do_not_change,
        cpu_suite._prompts_diverging_inside_a_block_resume_at_the_block_before,
        cpu_suite._another_adapter_never_resumes_from_the_base_models_blocks,
        cpu_suite._eviction_between_turns_and_a_miss_still_give_the_same_tokens,
        cpu_suite._preempting_a_sequence_that_shares_pages_leaves_the_others_whole,
    ],
    ids=lambda scenario: scenario.__name__.strip("_"),
)
def test_the_cpu_suites_cache_scenarios_give_the_same_tokens_on_the_device(device_model, scenario):
    scenario(device_model)  # each asserts the same tokens with the cache on and off


@pytest.mark.parametrize("snapshot_slots", [32, 3])
def test_a_conversation_resumes_from_snapshots_on_the_device_with_its_cold_tokens(
    device_model, snapshot_slots
):
    # 3 snapshot slots: full after the first turn, so later snapshots evict the least
    # recently used and are copied into reused slots.
    off = cpu_suite.Driver(make_engine(device_model, total_kv_pages=128, page_size=4))
    on = cpu_suite.Driver(
        cpu_suite._cached_engine(device_model, total_snapshot_slots=snapshot_slots)
    )
    assert on.engine._state_pool.conv.device.type == DEVICE.type
    assert cpu_suite._conversation(on) == cpu_suite._conversation(off)
    assert on.engine.prefix_cache.num_resumes == 2  # turns 2 and 3
    assert on.cached_tokens > 0 and on.computed_tokens < off.computed_tokens
    report(
        f"conversation with {snapshot_slots} snapshot slots: {on.cached_tokens} tokens "
        f"resumed, {on.computed_tokens} computed (cold: {off.computed_tokens})"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("preset", ["tiny", "tiny-next"])
def test_a_resume_from_a_snapshot_is_bitwise_the_cold_computation(preset, dtype):
    # The shared prefix: 80 tokens (past one GDN chunk of 64), prefilled in chunks of 40,
    # so its forwards end on block boundaries and leave snapshots at 40 and 80.
    model = load_model(preset, device=DEVICE, dtype=dtype)
    vocab = model.config.vocab_size
    shared = random_prompt(80, seed=40, vocab_size=vocab)
    first = SequenceSpec((*shared, *random_prompt(11, seed=41, vocab_size=vocab)), 8, logprobs=2)
    second = SequenceSpec((*shared, *random_prompt(13, seed=42, vocab_size=vocab)), 12, logprobs=2)

    cached = make_engine(model, cache_block_tokens=BLOCK, total_snapshot_slots=16)
    generate(cached, {1: first}, chunk_len=40)
    # Resumed at 80: pages [0, 80) shared, the GDN state at 80 copied in from its
    # snapshot; then [80, 93) computed, as the cold run computes it.
    resumed = generate(cached, {2: second}, chunk_len=40, cached={2: 80})
    assert cached.prefix_cache.num_resumes == 1
    assert cached.prefix_cache.num_resumed_tokens == 80

    cold = generate(make_engine(model), {2: second}, chunk_len=40)
    assert_bitwise_equal(cold, resumed)
    report(
        f"{preset} {dtype}: a resume at 80 tokens is bitwise the cold run ({len(cold[2])} tokens)"
    )
