"""Our model's logits equal transformers' on the same checkpoint, for every family
(Qwen3.5 dense, Qwen3.5 MoE, Qwen3-Next), under the policy of tolerance.py:
equal in float64, and a float32 error no larger than transformers' own."""

from __future__ import annotations

import pytest
import torch

from worker_client.engine.api import SequenceSpec
from worker_client.engine.loading import load_model

from .conftest import build_hf_checkpoint
from .factories import PagedPools, make_engine, random_prompt, run_to_completion
from .tolerance import (
    FLOAT64_RTOL,
    Float64Transformers,
    assert_float32_error_bounded,
    assert_float64_equal,
    max_abs,
)

CHUNK_LENGTHS = [
    5,
    1,
    7,
    64,
    3,
    70,
]  # 150 tokens: straddling the GDN chunk size (64) and many 4-token pages
LONG_PROMPT = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(1)).tolist()


def hf_logits(reference: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([token_ids])).logits[0]


def full_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids]), torch.arange(len(token_ids))[None])[0]


def paged_prefill_then_decode(
    model, prompt: list[int], num_decode_steps: int
) -> tuple[torch.Tensor, list[int]]:
    """Logits of uneven prompt chunks through pages, then of greedy single-token decode steps; and the tokens."""
    pools = PagedPools(model, num_pages=64, page_size=4, num_slots=2)
    slot = pools.state_pool.acquire()
    logits, start = [], 0
    with torch.no_grad():
        for length in CHUNK_LENGTHS:
            positions = torch.arange(start, start + length)[None]
            cache = pools.forward_cache([0], [slot], positions)
            logits.append(
                model(torch.tensor([prompt[start : start + length]]), positions, cache)[0]
            )
            start += length
        sequence = prompt + [int(logits[-1][-1].argmax())]
        for _ in range(num_decode_steps):
            positions = torch.tensor([[len(sequence) - 1]])
            cache = pools.forward_cache([0], [slot], positions)
            logits.append(model(torch.tensor([[sequence[-1]]]), positions, cache))
            sequence.append(int(logits[-1][-1, -1].argmax()))
    return torch.cat([chunk.reshape(-1, chunk.shape[-1]) for chunk in logits]), sequence


def test_full_prompt_logits_match_transformers_across_gdn_chunk_boundaries(family):
    exact = family.hf64.logits(LONG_PROMPT)
    assert_float64_equal(full_logits(family.ours64, LONG_PROMPT), exact)
    assert_float32_error_bounded(
        full_logits(family.ours, LONG_PROMPT),
        hf_logits(family.checkpoint.reference, LONG_PROMPT),
        exact,
    )


def test_tied_embeddings_checkpoint_logits_match_transformers(tmp_path):
    checkpoint = build_hf_checkpoint(tmp_path, tie_word_embeddings=True, seed=3)
    model = load_model(checkpoint.path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    prompt = list(range(2, 40))
    exact = Float64Transformers(checkpoint.reference).logits(prompt)
    assert_float64_equal(
        full_logits(load_model(checkpoint.path, dtype=torch.float64), prompt), exact
    )
    assert_float32_error_bounded(
        full_logits(model, prompt), hf_logits(checkpoint.reference, prompt), exact
    )


def test_uneven_chunked_prefill_then_decode_through_pages_matches_transformers(family):
    prompt = list(random_prompt(150, seed=2))
    ours64, sequence = paged_prefill_then_decode(family.ours64, prompt, num_decode_steps=6)
    exact = family.hf64.logits(sequence[:-1])
    assert_float64_equal(ours64, exact)
    ours32, sequence32 = paged_prefill_then_decode(family.ours, prompt, num_decode_steps=6)
    assert sequence32 == sequence  # greedy tokens: exact
    assert_float32_error_bounded(
        ours32, hf_logits(family.checkpoint.reference, sequence[:-1]), exact
    )


def test_engine_greedy_tokens_match_transformers_argmax(family):
    prompt = random_prompt(70, seed=4)
    engine = make_engine(family.ours, page_size=4)
    spec = SequenceSpec(prompt_token_ids=prompt, max_new_tokens=8)
    generated = run_to_completion(engine, seq_id=3, spec=spec, chunk_lengths=[5, 1, 7, 57])
    expected, sequence = [], list(prompt)
    for _ in range(8):
        token = int(hf_logits(family.checkpoint.reference, sequence)[-1].argmax())
        expected.append(token)
        sequence.append(token)
        if token == 1:  # EOS of the test checkpoints
            break
    assert generated == expected


@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", "qwen3_next"])
def test_a_millionth_of_error_in_one_expert_fails_the_float64_comparison(tmp_path, model_type):
    # The float64 bound is not loose: one expert of one layer scaled by 1 + 1e-6 is caught.
    checkpoint = build_hf_checkpoint(tmp_path, model_type=model_type)
    model = load_model(checkpoint.path, dtype=torch.float64)
    with torch.no_grad():
        model.model.layers[3].mlp.experts.down_proj[5] *= 1 + 1e-6
    exact = Float64Transformers(checkpoint.reference).logits(LONG_PROMPT)
    assert max_abs(full_logits(model, LONG_PROMPT) - exact) > 10 * FLOAT64_RTOL * max_abs(exact)
