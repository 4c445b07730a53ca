"""The contract between a worker loop and any inference engine.

A worker loop (written elsewhere) turns each scheduler decision into one
`Engine.step` call and reports the `StepOutput` back. These types are the whole
boundary: plain frozen dataclasses and enums, nothing engine-specific.
"""
from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


class FinishReason(enum.Enum):
    """Why a sequence ended inside the engine."""

    EOS = "eos"
    MAX_LENGTH = "max_length"
    STOP = "stop"
    FAILED = "failed"


@dataclass(frozen=True)
class SequenceSpec:
    """What the scheduler sends with a sequence's first chunk.

    After a requeue, `prompt_token_ids` is the original prompt followed by the
    tokens generated so far and `max_new_tokens` counts only what is left.
    """

    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    adapter_id: str = ""
    # Log-probabilities of each generated token and of its `logprobs` most likely
    # alternatives (0 = none). Taken from the model's raw distribution (log_softmax of the
    # logits, temperature, top-k and top-p NOT applied), as OpenAI and vLLM report them.
    logprobs: int = 0
    # The same for every prompt token after the first, reported with the first token.
    # Such a sequence needs every prompt position's logits: it must not take its prompt
    # from a prefix cache (see `needs_all_prompt_logits`).
    prompt_logprobs: int = 0
    ignore_eos: bool = False  # EOS does not end it (max_new_tokens or a stop token does)
    min_new_tokens: int = 0  # EOS and stop tokens do not end it before this many tokens

    @property
    def needs_all_prompt_logits(self) -> bool:
        """Whether prefill must keep every prompt position's logits (and so the prompt
        cannot come from a prefix cache)."""
        return self.prompt_logprobs > 0


@dataclass(frozen=True)
class TokenLogprobs:
    """The log-probability of one token, and the most likely tokens at its position."""

    logprob: float
    top_token_ids: tuple[int, ...] = ()  # most likely first
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class ChunkWork:
    """Prefill prompt tokens [chunk_start, chunk_start + chunk_len) of one sequence.

    `spec` is set on the first chunk (chunk_start 0) and None on continuations.
    """

    seq_id: int
    chunk_start: int
    chunk_len: int
    spec: SequenceSpec | None


@dataclass(frozen=True)
class FinishedSequence:
    """A sequence that ended this step; `generated_tokens` counts this admission only."""

    seq_id: int
    reason: FinishReason
    generated_tokens: int
    error_message: str = ""  # why, for FAILED: words a person can act on


@dataclass(frozen=True)
class StepOutput:
    """What one `Engine.step` produced."""

    # (seq_id, new token ids this step), including the first token sampled
    # right after a sequence's last prefill chunk.
    tokens: tuple[tuple[int, tuple[int, ...]], ...]
    # Sequences that ended this step; their pages and slot are already freed.
    finished: tuple[FinishedSequence, ...]
    # Sequences the engine evicted on its own (out of KV pages or GDN slots, or
    # a chunk that skipped ahead of what was prefilled); their pages and slot
    # are freed and the scheduler should requeue them.
    preempted: tuple[int, ...]
    # (seq_id, one TokenLogprobs per token of its `tokens` entry), for sequences that asked.
    logprobs: tuple[tuple[int, tuple[TokenLogprobs, ...]], ...] = ()
    # (seq_id, one TokenLogprobs per prompt token after the first), in the step that
    # produced the sequence's first token, for sequences that asked.
    prompt_logprobs: tuple[tuple[int, tuple[TokenLogprobs, ...]], ...] = ()


class Engine(Protocol):
    """What a worker loop drives; see ModelEngine for the reference implementation."""

    page_size: int
    total_kv_pages: int
    total_gdn_slots: int

    def kv_free_pages(self) -> int: ...

    def gdn_free_slots(self) -> int: ...

    def waiting_ids(self) -> list[int]:
        """Sequences held whose prompt is not fully prefilled."""
        ...

    def running_ids(self) -> list[int]:
        """Sequences held in decode."""
        ...

    def evict(self, seq_ids: Iterable[int]) -> None:
        """Drop these sequences and free their pages and slot; unknown ids are ignored."""
        ...

    def step(self, prefill: Sequence[ChunkWork], decode: Sequence[int]) -> StepOutput:
        """Run the named prefill chunks, then one decode pass over `decode`."""
        ...
