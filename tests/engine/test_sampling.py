"""Sampling is a function of (logits, params, seed, absolute position); resuming changes nothing."""

from __future__ import annotations

import pytest
import torch

from worker_client.engine.api import SequenceSpec
from worker_client.engine.reference import generate_reference
from worker_client.engine.sampling import SamplingParams, sample_token, uniform_for

from .factories import chunks_for, make_engine, random_prompt, run_to_completion, tokens_of

SAMPLING_CASES = {
    "greedy": SamplingParams(),
    "temperature": SamplingParams(temperature=1.3, seed=7),
    "top_k": SamplingParams(temperature=1.0, top_k=20, seed=8),
    "top_p": SamplingParams(temperature=0.9, top_p=0.8, seed=9),
    "top_k_and_top_p": SamplingParams(temperature=1.1, top_k=50, top_p=0.95, seed=10),
}


def flat_logits(seed: int) -> torch.Tensor:
    return torch.randn(512, generator=torch.Generator().manual_seed(seed))


def test_same_seed_and_position_give_the_same_token():
    params = SamplingParams(temperature=1.0, seed=42)
    logits = flat_logits(0)
    assert sample_token(logits, params, position=17) == sample_token(
        logits.clone(), params, position=17
    )
    assert uniform_for(42, 17) == uniform_for(42, 17)


def test_different_positions_or_seeds_draw_different_numbers():
    draws = {uniform_for(seed, position) for seed in range(5) for position in range(50)}
    assert len(draws) == 250
    assert all(0.0 <= u < 1.0 for u in draws)


def test_greedy_takes_the_argmax_and_top_k_one_is_greedy():
    logits = flat_logits(1)
    expected = int(logits.argmax())
    assert sample_token(logits, SamplingParams(), position=0) == expected
    for position in range(20):
        assert (
            sample_token(logits, SamplingParams(temperature=2.0, top_k=1, seed=3), position)
            == expected
        )


def test_top_k_and_top_p_only_draw_from_the_kept_candidates():
    logits = flat_logits(2)
    top5 = set(torch.topk(logits, 5).indices.tolist())
    probs = torch.softmax(logits, -1)
    sorted_probs, order = torch.sort(probs, descending=True)
    nucleus_size = int((torch.cumsum(sorted_probs, 0) - sorted_probs < 0.5).sum())
    nucleus = set(order[:nucleus_size].tolist())
    top_k_draws = {
        sample_token(logits, SamplingParams(temperature=1.0, top_k=5, seed=1), p)
        for p in range(300)
    }
    top_p_draws = {
        sample_token(logits, SamplingParams(temperature=1.0, top_p=0.5, seed=1), p)
        for p in range(300)
    }
    assert top_k_draws <= top5 and len(top_k_draws) > 1
    assert top_p_draws <= nucleus and len(top_p_draws) > 1


def test_temperature_sampling_draws_tokens_in_proportion_to_probability():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    counts = torch.zeros(4)
    for position in range(4000):
        counts[sample_token(logits, SamplingParams(temperature=1.0, seed=5), position)] += 1
    torch.testing.assert_close(counts / 4000, torch.softmax(logits, -1), atol=0.03, rtol=0.0)


@pytest.mark.parametrize("case", SAMPLING_CASES)
def test_resumed_sequence_samples_the_same_continuation(tiny_model, case):
    params = SAMPLING_CASES[case]
    prompt = random_prompt(20, seed=50)

    def spec(prompt_ids: tuple[int, ...], max_new_tokens: int) -> SequenceSpec:
        return SequenceSpec(
            prompt_ids,
            max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
        )

    uninterrupted = run_to_completion(make_engine(tiny_model), 1, spec(prompt, 12), [7, 13])
    reference = generate_reference(tiny_model, prompt, 12, sampling=params)
    assert uninterrupted == list(reference.token_ids)

    engine = make_engine(tiny_model)
    first_part = []
    for chunk in chunks_for(1, spec(prompt, 12), [20]):
        first_part += tokens_of(engine.step([chunk], []), 1)
    while len(first_part) < 5 and 1 in engine.running_ids():
        first_part += tokens_of(engine.step([], [1]), 1)
    engine.evict([1])  # the scheduler requeues it: prompt + generated so far, what is left to do
    resumed_spec = spec(prompt + tuple(first_part), 12 - len(first_part))
    rest = run_to_completion(engine, 1, resumed_spec, [4, 21])
    assert first_part + rest == uninterrupted
