"""A scripted engine with no model, for testing schedulers, loops and deployments.

Its next token is a fixed function of the whole prefix (`next_token`), so outputs are
deterministic and a resumed sequence continues exactly as an uninterrupted one would.
It keeps real page and slot accounting, so the scheduler sees honest free counts, and it
can take simulated GPU time per step (`step_seconds`), so that a test can land a fault
while sequences are still running. With `cache_block_tokens` it keeps a prefix cache with
the reference engine's books (engine/prefix_cache.py over the same PageTables); the
scripted model counts as a hybrid one (`recurrent`): a resume point needs a step that
ended on its block boundary.

Log-probabilities are fake but deterministic (`scripted_logprobs`): the scripted token is
the most likely one, its log-probability a hash of the prefix in [-0.98, -0.01], each
alternative one nat below the previous. It has no EOS: `ignore_eos` changes nothing, and
`min_new_tokens` holds off its stop tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from worker_client.engine.api import (
    ChunkWork,
    FinishedSequence,
    FinishReason,
    SequenceSpec,
    StepOutput,
    TokenLogprobs,
)
from worker_client.engine.books import CacheBooks
from worker_client.engine.page_tables import PageTables
from worker_client.engine.prefix_cache import cached_tokens_problem


def next_token(prefix: Sequence[int], vocab_size: int = 1000) -> int:
    """The scripted model: a hash of the prefix (position-sensitive)."""
    h = 7
    for token in prefix:
        h = (h * 31 + token + 1) % 1_000_003
    return h % vocab_size


def scripted_logprobs(
    prefix: Sequence[int], token_id: int, num_top: int, vocab_size: int = 1000
) -> TokenLogprobs:
    """The scripted model's log-probabilities of `token_id` after `prefix` and of its
    `num_top` most likely tokens: the scripted next token first, at a hash of the prefix in
    [-0.98, -0.01], then the following ids, one nat lower each; any other token is 10
    nats below the scripted one."""
    best = next_token(prefix, vocab_size)
    best_logprob = -((next_token([*prefix, 0], 97) + 1) / 100)
    top_ids = tuple((best + i) % vocab_size for i in range(min(num_top, vocab_size)))
    top = tuple(best_logprob - i for i in range(len(top_ids)))
    logprob = top[top_ids.index(token_id)] if token_id in top_ids else best_logprob - 10.0
    return TokenLogprobs(logprob, top_ids, top)


def reference_output(
    prompt: Sequence[int],
    max_new_tokens: int,
    stop_token_ids: Iterable[int] = (),
    vocab_size: int = 1000,
    min_new_tokens: int = 0,
) -> list[int]:
    """What ScriptedEngine generates for a sequence run without interruption."""
    stops, out, prefix = set(stop_token_ids), [], list(prompt)
    while len(out) < max_new_tokens:
        token = next_token(prefix, vocab_size)
        out.append(token)
        prefix.append(token)
        if token in stops and len(out) >= min_new_tokens:
            break
    return out


@dataclass
class _Held:
    seq_id: int
    spec: SequenceSpec
    token_ids: list[int]  # prompt, then generated tokens
    cached_tokens: int = 0  # tokens with KV positions: its progress
    num_generated: int = 0
    slot: int = 0  # GDN slots are counted, not numbered: the scripted model has no state
    block_hashes: list[int] = field(default_factory=list)  # kept by the prefix cache


class ScriptedEngine(CacheBooks):
    """Implements engine.api.Engine with `next_token` in place of a model."""

    def __init__(
        self,
        *,
        total_kv_pages: int = 256,
        page_size: int = 16,
        total_gdn_slots: int = 32,
        vocab_size: int = 1000,
        step_seconds: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
        cache_block_tokens: int = 0,
        total_snapshot_slots: int = 64,
        recurrent: bool = True,
        max_cached_blocks: int | None = None,
    ) -> None:
        """`step_seconds`: simulated GPU time, slept once by each step that has work.
        `cache_block_tokens` (0: no prefix cache), `total_snapshot_slots`, `recurrent`
        (False: every cached block is a resume point) and `max_cached_blocks` as for
        ModelEngine."""
        if step_seconds < 0:
            raise ValueError(f"step_seconds must not be negative, got {step_seconds}")
        self.page_size = page_size
        self.total_kv_pages = total_kv_pages
        self.total_gdn_slots = total_gdn_slots
        self.cache_block_tokens = cache_block_tokens
        self.total_snapshot_slots = total_snapshot_slots if cache_block_tokens and recurrent else 0
        self._vocab_size = vocab_size
        self.step_seconds = step_seconds
        self._sleep = sleep
        self._keep_books(
            PageTables(num_pages=total_kv_pages, page_size=page_size),
            cache_block_tokens=cache_block_tokens,
            snapshot_slots=self.total_snapshot_slots,
            needs_snapshots=recurrent,
            max_unused_blocks=max_cached_blocks,
        )
        self._held: dict[int, _Held] = {}  # admission order

    def gdn_free_slots(self) -> int:
        return self.total_gdn_slots - len(self._held)

    def waiting_ids(self) -> list[int]:
        return [s for s, h in self._held.items() if h.cached_tokens < len(h.spec.prompt_token_ids)]

    def running_ids(self) -> list[int]:
        return [s for s, h in self._held.items() if h.cached_tokens >= len(h.spec.prompt_token_ids)]

    # Handoffs: not supported (the scripted engine keeps no state to move).
    # lattice-worker refuses --role prefill and decode for it.
    can_hand_off = False
    handoff_bytes_per_token = 0.0
    handoff_fixed_bytes = 0.0

    def export_sequence(self, seq_id: int, first_token: int = 0):
        raise NotImplementedError("ScriptedEngine cannot hand sequences off")

    def import_sequence(self, seq_id, spec, chunks, cached_tokens: int = 0) -> None:
        raise NotImplementedError("ScriptedEngine cannot hand sequences off")

    def evict(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._release(seq_id)

    def step(self, prefill: Sequence[ChunkWork], decode: Sequence[int]) -> StepOutput:
        tokens: list[tuple[int, tuple[int, ...]]] = []
        finished: list[FinishedSequence] = []
        preempted: list[int] = []
        logprobs: list[tuple[int, tuple[TokenLogprobs, ...]]] = []
        prompt_logprobs: list[tuple[int, tuple[TokenLogprobs, ...]]] = []
        misses: list[int] = []
        if self.step_seconds and (prefill or decode):
            self._sleep(self.step_seconds)
        for chunk in prefill:
            if chunk.spec is not None:
                self._release(chunk.seq_id)
                if self.gdn_free_slots() == 0:
                    preempted.append(chunk.seq_id)
                    continue
                if not self._admit(chunk, finished, misses):
                    continue
            held = self._held.get(chunk.seq_id)
            if held is None:
                continue
            # A chunk that starts past our progress means a decision was lost on the way:
            # give the sequence back rather than prefill around a gap.
            if chunk.chunk_start > held.cached_tokens:
                self._release(chunk.seq_id)
                preempted.append(chunk.seq_id)
                continue
            num_new = (
                min(chunk.chunk_start + chunk.chunk_len, len(held.spec.prompt_token_ids))
                - held.cached_tokens
            )
            if num_new <= 0:
                continue
            if not self._grow(held, num_new):
                self._release(chunk.seq_id)
                preempted.append(chunk.seq_id)
                continue
            if held.cached_tokens >= len(held.spec.prompt_token_ids):
                self._sample(chunk.seq_id, held, tokens, finished, logprobs, prompt_logprobs)
        for seq_id in decode:
            held = self._held.get(seq_id)
            if held is None or held.cached_tokens < len(held.spec.prompt_token_ids):
                continue
            if not self._grow(held, 1):
                self._release(seq_id)
                preempted.append(seq_id)
                continue
            self._sample(seq_id, held, tokens, finished, logprobs, prompt_logprobs)
        return StepOutput(
            tuple(tokens),
            tuple(finished),
            tuple(preempted),
            tuple(misses),
            tuple(logprobs),
            tuple(prompt_logprobs),
        )

    def _admit(self, chunk: ChunkWork, finished, misses) -> bool:
        """Hold a new admission, from its resume point if it names one; False if not held."""
        spec, cached = chunk.spec, chunk.cached_tokens
        held = _Held(chunk.seq_id, spec, list(spec.prompt_token_ids))
        if cached:
            problem = cached_tokens_problem(
                cached, len(spec.prompt_token_ids), self.cache_block_tokens
            )
            if problem is not None:
                finished.append(FinishedSequence(chunk.seq_id, FinishReason.FAILED, 0, problem))
                return False
            if (
                self._cache is None
                or not spec.may_resume_from_cache
                or not self._cache.resume(held, cached)
            ):
                misses.append(chunk.seq_id)
                return False
            held.cached_tokens = cached
        self._held[chunk.seq_id] = held
        return True

    def _sample(
        self, seq_id: int, held: _Held, tokens, finished, logprobs, prompt_logprobs
    ) -> None:
        spec = held.spec
        token = next_token(held.token_ids, self._vocab_size)
        if spec.prompt_logprobs and not held.num_generated:
            prompt = spec.prompt_token_ids
            prompt_logprobs.append(
                (
                    seq_id,
                    tuple(
                        scripted_logprobs(
                            prompt[:p], prompt[p], spec.prompt_logprobs, self._vocab_size
                        )
                        for p in range(1, len(prompt))
                    ),
                )
            )
        if spec.logprobs:
            logprobs.append(
                (
                    seq_id,
                    (scripted_logprobs(held.token_ids, token, spec.logprobs, self._vocab_size),),
                )
            )
        held.token_ids.append(token)
        held.num_generated += 1
        tokens.append((seq_id, (token,)))
        reason = None
        if token in spec.stop_token_ids and held.num_generated >= spec.min_new_tokens:
            reason = FinishReason.STOP
        elif held.num_generated >= held.spec.max_new_tokens:
            reason = FinishReason.MAX_LENGTH
        if reason is not None:
            self._release(seq_id)
            finished.append(FinishedSequence(seq_id, reason, held.num_generated))

    def _grow(self, held: _Held, num_tokens: int) -> bool:
        """Take the pages of `num_tokens` more positions (reclaiming cache); the tokens
        are "computed" at once, so the cache registers its blocks."""
        num_new_pages = self._pages.num_new_pages(held.seq_id, num_tokens)
        if num_new_pages > self.kv_free_pages():
            return False
        self._append_pages(held.seq_id, num_tokens)
        held.cached_tokens += num_tokens
        if self._cache is not None:
            self._cache.computed(held, held.cached_tokens)
        return True

    def _release(self, seq_id: int) -> None:
        held = self._held.pop(seq_id, None)
        if held is not None:
            self._release_books(held)
