"""Token sampling: greedy, temperature, top-k and top-p, reproducible per position.

The one random number behind each draw is a pure function of (seed, absolute
position of the token being sampled), so a sequence resumed from its prompt
plus the tokens generated so far samples exactly what it would have sampled.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .api import SequenceSpec, TokenLogprobs


@dataclass(frozen=True)
class SamplingParams:
    """How to pick a token; temperature <= 0 is greedy, top_k 0 and top_p 0 (or >= 1) are off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int = 0

    @classmethod
    def from_spec(cls, spec: SequenceSpec) -> SamplingParams:
        return cls(temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p, seed=spec.seed)

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0


def uniform_for(seed: int, position: int) -> float:
    """A number in [0, 1) determined only by (seed, position), identical on every host."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def sample_token(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Pick a token from `logits` [vocab] for the token at absolute `position`.

    Greedy takes the lowest index among the maxima. Otherwise the candidates are
    sorted by probability (ties by index), cut by top-k then top-p (the smallest
    prefix whose mass reaches top_p), and one is drawn by inverse CDF with
    uniform_for(seed, position).
    """
    if params.is_greedy:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    keep = sorted_probs.shape[0]
    if params.top_k > 0:
        keep = min(keep, params.top_k)
    if 0.0 < params.top_p < 1.0:
        cumulative = torch.cumsum(sorted_probs[:keep], dim=0)
        # Count of candidates whose preceding mass is below top_p (always at least one).
        keep = max(1, int((cumulative - sorted_probs[:keep] < params.top_p).sum().item()))
    cumulative = torch.cumsum(sorted_probs[:keep], dim=0)
    target = uniform_for(params.seed, position) * cumulative[-1].item()
    index = int(
        torch.searchsorted(
            cumulative,
            torch.tensor([target], dtype=cumulative.dtype, device=cumulative.device),
            right=True,
        ).item()
    )
    return int(order[min(index, keep - 1)].item())


# Rows of logits turned into log-probabilities at once (bounds the float copies and the sort).
_LOGPROB_ROWS = 64


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> list[TokenLogprobs]:
    """For each row of `logits` [rows, vocab], the log-probability of `token_ids[row]` and
    of the row's `num_top` most likely tokens (most likely first, ties by lowest index).

    From the model's raw distribution: log_softmax of the logits (at least float32), with no
    temperature, top-k or top-p applied (what OpenAI and vLLM report). Rows are taken
    `_LOGPROB_ROWS` at a time, so that a long prompt's log_softmax and sort stay small."""
    if logits.shape[0] > _LOGPROB_ROWS:
        return [
            entry
            for first in range(0, logits.shape[0], _LOGPROB_ROWS)
            for entry in token_logprobs(
                logits[first : first + _LOGPROB_ROWS],
                token_ids[first : first + _LOGPROB_ROWS],
                num_top,
            )
        ]
    logprobs = torch.log_softmax(
        logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1
    )
    chosen = (
        logprobs.gather(1, token_ids.to(logprobs.device).long().unsqueeze(1)).squeeze(1).tolist()
    )
    if num_top <= 0:
        return [TokenLogprobs(lp) for lp in chosen]
    # A stable descending sort gives ties to the lowest index (torch.topk does not promise it).
    top_values, top_ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    top_values, top_ids = top_values[:, :num_top].tolist(), top_ids[:, :num_top].tolist()
    return [
        TokenLogprobs(lp, tuple(ids), tuple(values))
        for lp, ids, values in zip(chosen, top_ids, top_values)
    ]
