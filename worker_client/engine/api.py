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
    # Such a sequence needs every prompt position's logits: it is never resumed from a
    # prefix cache (see `needs_all_prompt_logits`).
    prompt_logprobs: int = 0
    ignore_eos: bool = False  # EOS does not end it (max_new_tokens or a stop token does)
    min_new_tokens: int = 0  # EOS and stop tokens do not end it before this many tokens
    # False: never resume this sequence from a prefix cache; its blocks are still cached.
    # (A spec that needs_all_prompt_logits is never resumed either.)
    use_prefix_cache: bool = True

    @property
    def needs_all_prompt_logits(self) -> bool:
        """Whether prefill must keep every prompt position's logits (and so the prompt
        cannot come from a prefix cache)."""
        return self.prompt_logprobs > 0

    @property
    def may_resume_from_cache(self) -> bool:
        """Whether its first chunk may start at a prefix cache's resume point."""
        return self.use_prefix_cache and not self.needs_all_prompt_logits


@dataclass(frozen=True)
class TokenLogprobs:
    """The log-probability of one token, and the most likely tokens at its position."""

    logprob: float
    top_token_ids: tuple[int, ...] = ()  # most likely first
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class ChunkWork:
    """Prefill prompt tokens [chunk_start, chunk_start + chunk_len) of one sequence.

    `spec` is set on the first chunk and None on continuations. A first chunk starts at
    0, or at `cached_tokens` > 0: a resume point the engine reported (a multiple of its
    `cache_block_tokens`, below the prompt's length), whose KV pages and GDN snapshot it
    maps instead of computing tokens [0, cached_tokens). An engine that no longer holds
    that resume point runs nothing for the sequence, holds nothing of it, and lists it in
    `StepOutput.cache_misses`.
    """

    seq_id: int
    chunk_start: int
    chunk_len: int
    spec: SequenceSpec | None
    cached_tokens: int = 0


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
    # First chunks whose resume point (cached_tokens) was gone: nothing ran for them and
    # the engine holds nothing of them; the scheduler hands each a first chunk again.
    cache_misses: tuple[int, ...] = ()
    # (seq_id, one TokenLogprobs per token of its `tokens` entry), for sequences that asked.
    logprobs: tuple[tuple[int, tuple[TokenLogprobs, ...]], ...] = ()
    # (seq_id, one TokenLogprobs per prompt token after the first), in the step that
    # produced the sequence's first token, for sequences that asked.
    prompt_logprobs: tuple[tuple[int, tuple[TokenLogprobs, ...]], ...] = ()


@dataclass(frozen=True)
class CacheDelta:
    """How an engine's prefix-cache resume points (block hashes) changed.

    `reset`: forget every earlier delta first; `added` then lists every current one.
    """

    added: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    reset: bool = False


class StateKind(enum.Enum):
    """What a StateChunk holds."""

    ATTENTION_KV = "attention_kv"  # keys then values of some positions of one attention layer
    GDN_RECURRENT = "gdn_recurrent"  # one GDN layer's recurrent (delta rule) state
    GDN_CONV = "gdn_conv"  # one GDN layer's causal-convolution state


@dataclass(frozen=True)
class StateChunk:
    """One piece of a held sequence's state, as `Engine.export_sequence` gives it and
    `Engine.import_sequence` takes it: raw bytes in the engine's own layout and dtypes
    (both ends run the same model, dtype and page layout; a size that does not fit is
    refused at import).

    `layer` counts layers of its kind (the i-th attention layer, the i-th GDN layer).
    ATTENTION_KV holds positions [first_token, first_token + num_tokens): that many
    [kv_heads, head_dim] keys, then as many values.
    """

    kind: StateKind
    layer: int
    data: bytes
    first_token: int = 0
    num_tokens: int = 0


class ImportProblem(enum.Enum):
    """Why an engine refused an import; it then holds nothing of the sequence."""

    NO_ROOM = "no_room"  # KV pages or a GDN slot short
    CACHE_MISS = "cache_miss"  # the resume point at cached_tokens is gone
    MALFORMED = "malformed"  # chunks missing, overlapping or of the wrong size
    INVALID = "invalid"  # the spec cannot run here (empty prompt, token out of vocabulary)


class ImportRefused(Exception):
    """`Engine.import_sequence` could not hold the sequence; `problem` says why."""

    def __init__(self, problem: ImportProblem, message: str) -> None:
        super().__init__(message)
        self.problem = problem


class Engine(Protocol):
    """What a worker loop drives; see ModelEngine for the reference implementation."""

    page_size: int
    total_kv_pages: int
    total_gdn_slots: int
    cache_block_tokens: int  # tokens per prefix-cache block; 0 = no prefix cache
    total_snapshot_slots: int  # GDN state snapshots it can keep besides total_gdn_slots

    def kv_free_pages(self) -> int:
        """Pages a new sequence can take: unused ones and those holding cache no held
        sequence uses (reclaimed on demand, least recently used first)."""
        ...

    def kv_cached_pages(self) -> int:
        """How many of kv_free_pages() hold reusable prefix cache."""
        ...

    def cache_delta(self, full: bool = False) -> CacheDelta:
        """Resume points added and removed since the last call; with `full`, a reset
        delta listing every current resume point instead."""
        ...

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

    # Handoffs (docs/disaggregation.md): an engine that cannot move a sequence to a peer
    # says so with `can_hand_off = False` and raises NotImplementedError from both.
    can_hand_off: bool
    # What one handoff moves (0 where it cannot hand off): attention KV bytes per token
    # over every attention layer, and the bytes of the GDN states whatever the length.
    handoff_bytes_per_token: float
    handoff_fixed_bytes: float

    def export_sequence(self, seq_id: int, first_token: int = 0) -> tuple[StateChunk, ...] | None:
        """A copy of running `seq_id`'s state: the attention KV of positions
        [first_token, len(tokens) - 1), then each GDN layer's recurrent and convolution
        state; None if it does not hold `seq_id` running. The sequence is left as it was."""
        ...

    def import_sequence(
        self, seq_id: int, spec: SequenceSpec, chunks: Iterable[StateChunk], cached_tokens: int = 0
    ) -> None:
        """Hold `seq_id` running from `spec` as if it had prefilled it: KV positions
        [0, cached_tokens) from its own prefix cache, the rest and the GDN states from
        `chunks` (exported by a peer with `first_token = cached_tokens`); the last token of
        the prompt is fed by its first decode. Takes free pages and a free slot, never
        preempts. Raises ImportRefused (holding nothing of it) when it cannot."""
        ...
