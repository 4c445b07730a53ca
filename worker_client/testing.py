"""A scripted engine with no model, for testing schedulers, loops and deployments.

Its next token is a fixed function of the whole prefix (`next_token`), so outputs are
deterministic and a resumed sequence continues exactly as an uninterrupted one would.
It keeps real page and slot accounting, so the scheduler sees honest free counts, and it
can take simulated GPU time per step (`step_seconds`), so that a test can land a fault
while sequences are still running.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from worker_client.engine.api import (
    CacheDelta, ChunkWork, FinishedSequence, FinishReason, SequenceSpec, StepOutput,
)


def next_token(prefix: Sequence[int], vocab_size: int = 1000) -> int:
    """The scripted model: a hash of the prefix (position-sensitive)."""
    h = 7
    for token in prefix:
        h = (h * 31 + token + 1) % 1_000_003
    return h % vocab_size


def reference_output(prompt: Sequence[int], max_new_tokens: int,
                     stop_token_ids: Iterable[int] = (), vocab_size: int = 1000) -> list[int]:
    """What ScriptedEngine generates for a sequence run without interruption."""
    stops, out, prefix = set(stop_token_ids), [], list(prompt)
    while len(out) < max_new_tokens:
        token = next_token(prefix, vocab_size)
        out.append(token)
        prefix.append(token)
        if token in stops:
            break
    return out


@dataclass
class _Held:
    spec: SequenceSpec
    cached_tokens: int = 0
    generated: list[int] = field(default_factory=list)

    @property
    def prefix(self) -> list[int]:
        return [*self.spec.prompt_token_ids, *self.generated]


class ScriptedEngine:
    """Implements engine.api.Engine with `next_token` in place of a model."""

    def __init__(self, *, total_kv_pages: int = 256, page_size: int = 16,
                 total_gdn_slots: int = 32, vocab_size: int = 1000, step_seconds: float = 0.0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        """`step_seconds`: simulated GPU time, slept once by each step that has work."""
        if step_seconds < 0:
            raise ValueError(f"step_seconds must not be negative, got {step_seconds}")
        self.page_size = page_size
        self.total_kv_pages = total_kv_pages
        self.total_gdn_slots = total_gdn_slots
        self.cache_block_tokens = 0  # no prefix cache: a first chunk with cached_tokens misses
        self.total_snapshot_slots = 0
        self._vocab_size = vocab_size
        self.step_seconds = step_seconds
        self._sleep = sleep
        self._held: dict[int, _Held] = {}  # admission order

    def kv_free_pages(self) -> int:
        return self.total_kv_pages - sum(self._pages(h.cached_tokens) for h in self._held.values())

    def gdn_free_slots(self) -> int:
        return self.total_gdn_slots - len(self._held)

    def kv_cached_pages(self) -> int:
        return 0

    def cache_delta(self, full: bool = False) -> CacheDelta:
        return CacheDelta(reset=full)

    def waiting_ids(self) -> list[int]:
        return [s for s, h in self._held.items() if h.cached_tokens < len(h.spec.prompt_token_ids)]

    def running_ids(self) -> list[int]:
        return [s for s, h in self._held.items()
                if h.cached_tokens >= len(h.spec.prompt_token_ids)]

    def evict(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._held.pop(seq_id, None)

    def step(self, prefill: Sequence[ChunkWork], decode: Sequence[int]) -> StepOutput:
        tokens: list[tuple[int, tuple[int, ...]]] = []
        finished: list[FinishedSequence] = []
        preempted: list[int] = []
        misses: list[int] = []
        if self.step_seconds and (prefill or decode):
            self._sleep(self.step_seconds)
        for chunk in prefill:
            if chunk.spec is not None:
                self._held.pop(chunk.seq_id, None)
                if chunk.cached_tokens:
                    misses.append(chunk.seq_id)
                    continue
                if self.gdn_free_slots() == 0:
                    preempted.append(chunk.seq_id)
                    continue
                self._held[chunk.seq_id] = _Held(chunk.spec)
            held = self._held.get(chunk.seq_id)
            if held is None:
                continue
            # A chunk that starts past our progress means a decision was lost on the way:
            # give the sequence back rather than prefill around a gap.
            if chunk.chunk_start > held.cached_tokens:
                self._held.pop(chunk.seq_id)
                preempted.append(chunk.seq_id)
                continue
            num_new = chunk.chunk_start + chunk.chunk_len - held.cached_tokens
            if num_new <= 0:
                continue
            if not self._grow(held, num_new):
                self._held.pop(chunk.seq_id)
                preempted.append(chunk.seq_id)
                continue
            if held.cached_tokens >= len(held.spec.prompt_token_ids):
                self._sample(chunk.seq_id, held, tokens, finished)
        for seq_id in decode:
            held = self._held.get(seq_id)
            if held is None or held.cached_tokens < len(held.spec.prompt_token_ids):
                continue
            if not self._grow(held, 1):
                self._held.pop(seq_id)
                preempted.append(seq_id)
                continue
            self._sample(seq_id, held, tokens, finished)
        return StepOutput(tuple(tokens), tuple(finished), tuple(preempted), tuple(misses))

    def _sample(self, seq_id: int, held: _Held, tokens, finished) -> None:
        token = next_token(held.prefix, self._vocab_size)
        held.generated.append(token)
        tokens.append((seq_id, (token,)))
        reason = None
        if token in held.spec.stop_token_ids:
            reason = FinishReason.STOP
        elif len(held.generated) >= held.spec.max_new_tokens:
            reason = FinishReason.MAX_LENGTH
        if reason is not None:
            self._held.pop(seq_id)
            finished.append(FinishedSequence(seq_id, reason, len(held.generated)))

    def _grow(self, held: _Held, num_tokens: int) -> bool:
        extra = self._pages(held.cached_tokens + num_tokens) - self._pages(held.cached_tokens)
        if extra > self.kv_free_pages():
            return False
        held.cached_tokens += num_tokens
        return True

    def _pages(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)
