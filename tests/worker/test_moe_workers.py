"""The whole system on the MoE members of the family: a scheduler, two `lattice-worker`
processes loading a transformers-written Qwen3.5 MoE or Qwen3-Next checkpoint, and 16
concurrent Generate streams of mixed lengths (so prefill chunks of several sequences
share a forward). Every stream's greedy tokens equal transformers' greedy tokens."""

from __future__ import annotations

import pytest

from lattice.scheduler.v1 import scheduler_pb2 as pb
from tests.worker.test_model_workers import MAX_NEW_TOKENS, Stack, assert_all_free, random_prompts

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from tests.engine.conftest import build_hf_checkpoint  # noqa: E402

EOS_TOKEN_ID = 1  # of the test checkpoints


def transformers_greedy(reference, prompt: list[int]) -> tuple[list[int], int]:
    """transformers' `generate`, greedy, for one prompt: the tokens after it and why it stopped."""
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            eos_token_id=EOS_TOKEN_ID,
            pad_token_id=0,
        )
    generated = out[0, len(prompt) :].tolist()
    if generated[-1] == EOS_TOKEN_ID:
        return generated, pb.FINISH_REASON_EOS
    return generated, pb.FINISH_REASON_MAX_LENGTH


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", "qwen3_next"])
def test_sixteen_streams_on_moe_checkpoint_workers_equal_transformers_greedy(tmp_path, model_type):
    checkpoint = build_hf_checkpoint(tmp_path / model_type, model_type=model_type, seed=7)
    stack = Stack()
    try:
        for worker_id in ("moe-1", "moe-2"):
            stack.add_worker(worker_id, kv_pages=512, model=str(checkpoint.path))
        stack.wait_registered(2)
        prompts = random_prompts(16, seed=21, max_len=90)
        results = stack.generate_all(prompts)
        for i, prompt in enumerate(prompts):
            assert results[i] == transformers_greedy(checkpoint.reference, prompt), f"stream {i}"
        assert_all_free(stack, ["moe-1", "moe-2"])
    finally:
        stack.close()
