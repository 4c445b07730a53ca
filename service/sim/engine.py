"""SimEngine: engine.api.Engine without a model, for the simulator.

It keeps the reference engine's books (worker_client/engine/engine.py, ModelEngine):
- KV pages of `page_size` tokens, taken as a sequence grows and freed when it leaves; a
  sequence holds prompt + generated - 1 positions once decoding (the last token is fed
  by the next decode);
- one GDN slot per held sequence; a first chunk that finds no free slot is preempted;
- chunked prefill with a cursor, every chunk of a step planned (and its pages reserved)
  before any runs, as ModelEngine packs them: a chunk overlapping what is prefilled or
  planned adds only its new tokens, one starting past it preempts the sequence (a lost
  decision), and a sequence preempted while planning runs nothing;
- one token per decode, and the first token right after the last prefill chunk; a
  sequence finishes (MAX_LENGTH) when it has generated its spec's max_new_tokens;
- when pages run out, the latest admitted sequence holding pages (possibly the one
  growing) is preempted, as ModelEngine does; one that could not fit even in the whole
  pool finishes FAILED.
It generates no EOS, so `ignore_eos` and `min_new_tokens` change nothing, and it reports no
log-probabilities (`logprobs`, `prompt_logprobs` are accepted and ignored: their cost, one
log_softmax per token asked for, is not in the cost models).
Instead of running a model, each step asks a cost model how long it took
(`last_step_seconds`), from the work actually done.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from worker_client.engine.api import (
    CacheDelta, ChunkWork, FinishedSequence, FinishReason, SequenceSpec, StepOutput,
)
from common.step_table import StepLoad

# Every simulated token has this id: the simulator counts tokens, it does not read them.
TOKEN_ID = 1


class CostModel(Protocol):
    """How long one engine step takes, in seconds."""

    def step_seconds(self, load: StepLoad) -> float: ...


@dataclass
class _Held:
    seq_id: int
    prompt_len: int
    max_new_tokens: int
    num_prefilled: int = 0
    num_generated: int = 0
    kv_tokens: int = 0  # KV positions reserved

    @property
    def is_running(self) -> bool:
        return self.num_prefilled >= self.prompt_len


class SimEngine:
    """Implements engine.api.Engine: page, slot and progress accounting, and a step time."""

    def __init__(self, cost_model: CostModel, *, total_kv_pages: int, page_size: int,
                 total_gdn_slots: int) -> None:
        if min(total_kv_pages, page_size, total_gdn_slots) < 1:
            raise ValueError("total_kv_pages, page_size and total_gdn_slots must be >= 1")
        self.cost_model = cost_model
        self.page_size = page_size
        self.total_kv_pages = total_kv_pages
        self.total_gdn_slots = total_gdn_slots
        # No prefix cache yet (its tokens are all TOKEN_ID): a cached first chunk misses.
        self.cache_block_tokens = 0
        self.total_snapshot_slots = 0
        self.last_step_seconds = 0.0
        self.num_steps = 0
        self._held: dict[int, _Held] = {}  # in admission order
        self._used_pages = 0

    def kv_free_pages(self) -> int:
        return self.total_kv_pages - self._used_pages

    def gdn_free_slots(self) -> int:
        return self.total_gdn_slots - len(self._held)

    def kv_cached_pages(self) -> int:
        return 0

    def cache_delta(self, full: bool = False) -> CacheDelta:
        return CacheDelta(reset=full)

    def waiting_ids(self) -> list[int]:
        return [s for s, held in self._held.items() if not held.is_running]

    def running_ids(self) -> list[int]:
        return [s for s, held in self._held.items() if held.is_running]

    def num_held_pages(self, seq_id: int) -> int:
        held = self._held.get(seq_id)
        return self._pages(held.kv_tokens) if held else 0

    def evict(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._release(seq_id)

    def step(self, prefill: Sequence[ChunkWork], decode: Sequence[int]) -> StepOutput:
        out = _Recorder()
        for segment in self._plan_prefill(prefill, out):
            held = segment.held
            out.chunks.append((segment.num_tokens, segment.start))
            held.num_prefilled = segment.end
            if held.is_running:
                self._emit(held, out)
        self._decode(decode, out)
        self.num_steps += 1
        self.last_step_seconds = self.cost_model.step_seconds(
            StepLoad(tuple(out.chunks), tuple(out.decodes)))
        return out.output()

    # Prefill.

    def _plan_prefill(self, prefill: Sequence[ChunkWork], out: _Recorder) -> list[_Segment]:
        """Admit, check and reserve room for every chunk, as ModelEngine plans its packed
        prefill; the prompt tokens each sequence adds this step."""
        planned: dict[int, _Segment] = {}
        for chunk in prefill:
            if chunk.spec is not None:
                self._release(chunk.seq_id)
                if chunk.cached_tokens:
                    out.cache_misses.append(chunk.seq_id)
                    continue
                self._admit(chunk.seq_id, chunk.spec, out)
            held = self._held.get(chunk.seq_id)
            if held is None or held.is_running:
                continue
            segment = planned.get(chunk.seq_id)
            if segment is None or segment.held is not held:  # none yet, or for a restarted one
                segment = planned[chunk.seq_id] = _Segment(held, held.num_prefilled)
            if chunk.chunk_start > segment.end:  # a lost decision: give the sequence back
                self._release(held.seq_id)
                out.preempted.append(held.seq_id)
                continue
            # A chunk overlapping what is prefilled (or planned) adds only its new tokens.
            num_tokens = min(chunk.chunk_start + chunk.chunk_len, held.prompt_len) - segment.end
            if num_tokens > 0 and self._reserve(held, num_tokens, out):
                segment.num_tokens += num_tokens
        # Sequences released while planning (preempted by a later chunk, restarted) run nothing.
        return [s for s in planned.values()
                if s.num_tokens > 0 and self._held.get(s.held.seq_id) is s.held]

    def _admit(self, seq_id: int, spec: SequenceSpec, out: _Recorder) -> None:
        if not spec.prompt_token_ids:
            out.finished.append(
                FinishedSequence(seq_id, FinishReason.FAILED, 0, "the prompt is empty"))
            return
        if spec.max_new_tokens <= 0:
            out.finished.append(FinishedSequence(seq_id, FinishReason.MAX_LENGTH, 0))
            return
        if self.gdn_free_slots() == 0:
            out.preempted.append(seq_id)
            return
        self._held[seq_id] = _Held(seq_id, len(spec.prompt_token_ids), spec.max_new_tokens)

    # Decode.

    def _decode(self, decode: Sequence[int], out: _Recorder) -> None:
        held_by_id = self._held
        batch = [h for s in decode if (h := held_by_id.get(s)) is not None and h.is_running]
        # Reserve in admission order (dict order), as the reference engine does: the
        # victims of a page shortage are then the latest admitted, not yet reserved.
        order = {s: i for i, s in enumerate(held_by_id)}
        contexts = {}
        for held in sorted(batch, key=lambda h: order[h.seq_id]):
            if held.seq_id not in held_by_id:
                continue
            context = held.kv_tokens
            if context % self.page_size:  # room left in its last page
                held.kv_tokens += 1
            elif not self._reserve(held, 1, out):
                continue
            contexts[held.seq_id] = context
        for held in batch:
            if held.seq_id in held_by_id:
                out.decodes.append(contexts[held.seq_id])
                self._emit(held, out)

    # Shared.

    def _emit(self, held: _Held, out: _Recorder) -> None:
        held.num_generated += 1
        out.tokens.append((held.seq_id, (TOKEN_ID,)))
        if held.num_generated >= held.max_new_tokens:
            self._release(held.seq_id)
            out.finished.append(
                FinishedSequence(held.seq_id, FinishReason.MAX_LENGTH, held.num_generated))

    def _reserve(self, held: _Held, num_tokens: int, out: _Recorder) -> bool:
        """Reserve KV room for num_tokens more tokens, preempting the latest admitted;
        False if `held` itself lost."""
        needed = self._pages(held.kv_tokens + num_tokens)
        if needed > self.total_kv_pages:
            self._release(held.seq_id)
            out.finished.append(FinishedSequence(
                held.seq_id, FinishReason.FAILED, held.num_generated,
                f"the sequence needs {needed} KV pages of {self.page_size} tokens, more than "
                f"the worker's {self.total_kv_pages} in all"))
            return False
        while needed - self._pages(held.kv_tokens) > self.kv_free_pages():
            victim = next(h for h in reversed(self._held.values())
                          if h is held or h.kv_tokens > 0)
            self._release(victim.seq_id)
            out.preempted.append(victim.seq_id)
            if victim is held:
                return False
        self._used_pages += needed - self._pages(held.kv_tokens)
        held.kv_tokens += num_tokens
        return True

    def _release(self, seq_id: int) -> None:
        held = self._held.pop(seq_id, None)
        if held is not None:
            self._used_pages -= self._pages(held.kv_tokens)

    def _pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


@dataclass
class _Segment:
    """Prompt tokens [start, start + num_tokens) of `held` planned for this step."""

    held: _Held
    start: int
    num_tokens: int = 0

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class _Recorder:
    """One step's tokens, finishes, preemptions and the work done (for the cost model)."""

    def __init__(self) -> None:
        self.tokens: list[tuple[int, tuple[int, ...]]] = []
        self.finished: list[FinishedSequence] = []
        self.preempted: list[int] = []
        self.cache_misses: list[int] = []
        self.chunks: list[tuple[int, int]] = []
        self.decodes: list[int] = []

    def output(self) -> StepOutput:
        return StepOutput(tuple(self.tokens), tuple(self.finished), tuple(self.preempted),
                          tuple(self.cache_misses))
