"""The scheduler uses a real tiny-model worker's prefix cache: a conversation's
turns resume from the last turn's resume point, with greedy tokens identical to caching
off. A real scheduler on a loopback port and a WorkerLoop on a ModelEngine."""

from __future__ import annotations

import random

import pytest

from bench.harness.engine_bench import PAGE_SIZE, SchedulerStack
from worker_client.engine.engine import ModelEngine
from worker_client.engine.loading import load_model

BLOCK = 4 * PAGE_SIZE


@pytest.mark.slow  # a model and a gRPC server
@pytest.mark.parametrize("policy", ["fifo", "budget"])
def test_each_turn_of_a_conversation_resumes_from_the_last_and_generates_the_same(policy):
    model = load_model("tiny", device="cpu", seed=0)
    rng = random.Random(5)
    replies = {}
    for caching in ("on", "off"):
        engine = ModelEngine(
            model,
            total_kv_pages=400,
            page_size=PAGE_SIZE,
            total_gdn_slots=4,
            device="cpu",
            max_batch_size=4,
            cache_block_tokens=BLOCK,
            total_snapshot_slots=16,
        )
        stack = SchedulerStack(
            engine,
            128,
            policy=policy,
            prefix_caching=caching,
            max_num_batched_tokens=160,
            min_prefill_chunk=16,
        )
        rng.seed(5)
        conversation: tuple[int, ...] = ()
        turns = []
        try:
            for _ in range(4):
                conversation += tuple(rng.randrange(2, 500) for _ in range(rng.randrange(40, 90)))
                answer, _ = stack.generate(conversation, 12)
                info = stack.get_sequence(stack.last_seq_id)
                turns.append((len(conversation), info.cached_tokens, answer))
                conversation += answer
        finally:
            stack.close()
        replies[caching] = turns
    assert [t[2] for t in replies["on"]] == [t[2] for t in replies["off"]]
    assert all(cached == 0 for _, cached, _ in replies["off"])
    previous = None
    for prompt_len, cached, _ in replies["on"]:
        assert cached % BLOCK == 0 and cached < prompt_len
        if previous is not None:
            # The last turn's prompt and answer are cached, up to the last block they filled.
            assert cached >= previous - BLOCK, (cached, previous)
        previous = prompt_len
    assert replies["on"][-1][1] > 0
