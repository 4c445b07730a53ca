"""A sequential generator without pages or state: the yardstick for the engine in tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .api import FinishReason
from .model import Qwen35ForCausalLM
from .sampling import SamplingParams, sample_token


@dataclass(frozen=True)
class GeneratedSequence:
    """The tokens generated after the prompt and why generation stopped."""

    token_ids: tuple[int, ...]
    reason: FinishReason


def generate_reference(
    model: Qwen35ForCausalLM,
    prompt_token_ids: Sequence[int],
    max_new_tokens: int,
    *,
    sampling: SamplingParams = SamplingParams(),
    stop_token_ids: Sequence[int] = (),
) -> GeneratedSequence:
    """Generate by re-running the whole sequence from token 0 for every new token.

    Quadratic and slow, but it shares nothing with the engine's caches. Stops
    on the config's EOS ids, a stop id, or after max_new_tokens (>= 1).
    """
    token_ids = list(prompt_token_ids)
    generated: list[int] = []
    eos_ids = model.config.eos_token_ids
    with torch.inference_mode():
        while True:
            ids = torch.tensor([token_ids], device=model.device)
            positions = torch.arange(len(token_ids), device=model.device)[None]
            logits = model(ids, positions, last_only=True)[0]
            token_id = sample_token(logits, sampling, position=len(token_ids))
            token_ids.append(token_id)
            generated.append(token_id)
            if token_id in eos_ids:
                return GeneratedSequence(tuple(generated), FinishReason.EOS)
            if token_id in stop_token_ids:
                return GeneratedSequence(tuple(generated), FinishReason.STOP)
            if len(generated) >= max_new_tokens:
                return GeneratedSequence(tuple(generated), FinishReason.MAX_LENGTH)
