"""What the engine keeps about one held sequence, and what one step has produced so far."""

from __future__ import annotations

from dataclasses import dataclass, field

from .api import FinishedSequence, FinishReason, SequenceSpec, StepOutput, TokenLogprobs
from .sampling import SamplingParams


@dataclass
class HeldSequence:
    """A sequence holding a GDN slot (and KV pages as it grows).

    Invariant: the KV cache and the GDN slot hold the first `num_prefilled`
    prompt tokens while waiting; once running, every token but the last of
    `token_ids` (the last is fed by the next decode).
    """

    seq_id: int
    spec: SequenceSpec
    slot: int
    admission: int  # increases with every admission; the latest admitted is preempted first
    sampling: SamplingParams
    token_ids: list[int] = field(default_factory=list)  # prompt, then generated tokens
    num_prefilled: int = 0
    num_generated: int = 0
    # Prompt tokens 1.. so far, for a spec with prompt_logprobs (kept across chunks).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Hashes of its leading full blocks that it maps from the prefix cache, in order.
    block_hashes: list[int] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.spec.prompt_token_ids)

    @property
    def is_running(self) -> bool:
        return self.num_prefilled >= self.prompt_len

    def finish_reason(self, token_id: int, eos_token_ids: tuple[int, ...]) -> FinishReason | None:
        """Why the sequence ends after sampling `token_id`, or None if it goes on."""
        spec = self.spec
        if self.num_generated >= spec.min_new_tokens:
            if token_id in eos_token_ids and not spec.ignore_eos:
                return FinishReason.EOS
            if token_id in spec.stop_token_ids:
                return FinishReason.STOP
        if self.num_generated >= spec.max_new_tokens:
            return FinishReason.MAX_LENGTH
        return None


@dataclass
class PrefillSegment:
    """Prompt tokens [start, start + num_tokens) of `held` planned for this step's prefill forward."""

    held: HeldSequence
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class StepRecorder:
    """Accumulates one step's tokens, finished and preempted sequences."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    finished: list[FinishedSequence] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    cache_misses: list[int] = field(default_factory=list)
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[int, tuple[TokenLogprobs, ...]] = field(default_factory=dict)

    def token(self, seq_id: int, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        self.tokens.setdefault(seq_id, []).append(token_id)
        if logprobs is not None:
            self.logprobs.setdefault(seq_id, []).append(logprobs)

    def prompt(self, seq_id: int, logprobs: list[TokenLogprobs]) -> None:
        self.prompt_logprobs[seq_id] = tuple(logprobs)

    def finish(
        self, seq_id: int, reason: FinishReason, generated_tokens: int, error_message: str = ""
    ) -> None:
        self.finished.append(FinishedSequence(seq_id, reason, generated_tokens, error_message))

    def preempt(self, seq_id: int) -> None:
        self.preempted.append(seq_id)

    def cache_miss(self, seq_id: int) -> None:
        self.cache_misses.append(seq_id)

    def output(self) -> StepOutput:
        return StepOutput(
            tokens=tuple((seq_id, tuple(ids)) for seq_id, ids in self.tokens.items()),
            finished=tuple(self.finished),
            preempted=tuple(self.preempted),
            cache_misses=tuple(self.cache_misses),
            logprobs=tuple((seq_id, tuple(lps)) for seq_id, lps in self.logprobs.items()),
            prompt_logprobs=tuple(self.prompt_logprobs.items()),
        )
