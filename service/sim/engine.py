"""SimEngine: engine.api.Engine without a model, for the simulator.

It keeps the reference engine's books (worker_client/engine/engine.py, ModelEngine), over
the same torch-free PageTables and, with a cache, the same PrefixCache:
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
  pool finishes FAILED;
- with `cache_block_tokens` > 0, a prefix cache (worker_client/engine/prefix_cache.py):
  every full block written (prompt or generated) is indexed by its chained hash, its
  pages stay cached after its sequence ends and count as free, reclaimed least recently
  used first; a first chunk with `cached_tokens` maps the cached blocks and computes
  only the rest, or, when that resume point is gone, runs nothing and is a cache miss.
  With `snapshot_slots` set the model counts as a hybrid one: a resume point also needs
  a GDN snapshot, taken where a step ended on a block boundary, `snapshot_slots` of them
  kept, least recently used out (as ModelEngine with GDN layers); without it every
  cached block is a resume point (a model of attention layers only).
It generates no EOS, so `ignore_eos` and `min_new_tokens` change nothing, and it reports no
log-probabilities (`logprobs`, `prompt_logprobs` are accepted and ignored: their cost, one
log_softmax per token asked for, is not in the cost models); a sequence that asks for
prompt log-probabilities is never resumed from the cache (`may_resume_from_cache`), as
in ModelEngine.
Instead of running a model, each step asks a cost model how long it took
(`last_step_seconds`), from the work actually done: a resumed prompt's cached tokens are
context for its chunk, not computed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from common.step_table import StepLoad
from worker_client.engine.api import (
    ChunkWork,
    FinishedSequence,
    FinishReason,
    SequenceSpec,
    StepOutput,
)
from worker_client.engine.books import CacheBooks
from worker_client.engine.page_tables import PageTables
from worker_client.engine.prefix_cache import cached_tokens_problem

# Every simulated output token has this id: the simulator counts tokens, it does not read them.
TOKEN_ID = 1


class CostModel(Protocol):
    """How long one engine step takes, in seconds."""

    def step_seconds(self, load: StepLoad) -> float: ...


@dataclass
class _Held:
    """A held sequence, as PrefixCache reads it (engine.prefix_cache.CachingSequence)."""

    seq_id: int
    spec: SequenceSpec
    token_ids: list[int]  # prompt, then generated tokens
    admission: int  # increases with every admission: the latest admitted is preempted first
    prompt_len: int
    num_prefilled: int = 0
    num_generated: int = 0
    slot: int = 0  # GDN slots are counted, not numbered: the simulated model has no state
    block_hashes: list[int] = field(default_factory=list)  # kept by the prefix cache
    # Tokens of context handed over by another worker (service/sim/transfer.py): held in
    # pages and attended to, never computed here.
    context_offset: int = 0

    @property
    def is_running(self) -> bool:
        return self.num_prefilled >= self.prompt_len


class SimEngine(CacheBooks):
    """Implements engine.api.Engine: page, slot, cache and progress accounting, and a step time."""

    def __init__(
        self,
        cost_model: CostModel,
        *,
        total_kv_pages: int,
        page_size: int,
        total_gdn_slots: int,
        cache_block_tokens: int = 0,
        snapshot_slots: int | None = None,
        imports: dict[int, int] | None = None,
    ) -> None:
        """`imports`: a prefill/decode split's handoffs, shared by the decode workers: a
        prompt whose first token id is a key starts with that many tokens of imported
        context (service/sim/transfer.py). `cache_block_tokens`: tokens per prefix-cache block (a multiple of page_size;
        0: no cache). `snapshot_slots`: None models a model without GDN layers (every
        cached block is a resume point); a number, a hybrid model with that many GDN
        snapshot slots (ModelEngine's total_snapshot_slots)."""
        if min(total_kv_pages, page_size, total_gdn_slots) < 1:
            raise ValueError("total_kv_pages, page_size and total_gdn_slots must be >= 1")
        if snapshot_slots is not None and snapshot_slots < 0:
            raise ValueError(f"snapshot_slots must be >= 0, got {snapshot_slots}")
        self.cost_model = cost_model
        self.page_size = page_size
        self.total_kv_pages = total_kv_pages
        self.total_gdn_slots = total_gdn_slots
        self.cache_block_tokens = cache_block_tokens
        hybrid = snapshot_slots is not None
        self.total_snapshot_slots = snapshot_slots if hybrid and cache_block_tokens else 0
        self.last_step_seconds = 0.0
        self.num_steps = 0
        self.num_computed_prefill_tokens = 0  # prompt tokens the steps computed
        self._imports = imports
        self.num_imports_resumed = 0  # imported sequences admitted again after a preemption
        self._keep_books(
            PageTables(num_pages=total_kv_pages, page_size=page_size),
            cache_block_tokens=cache_block_tokens,
            snapshot_slots=self.total_snapshot_slots,
            needs_snapshots=hybrid,
        )
        self._held: dict[int, _Held] = {}  # in admission order
        self._num_admissions = 0

    def gdn_free_slots(self) -> int:
        return self.total_gdn_slots - len(self._held)

    def waiting_ids(self) -> list[int]:
        return [s for s, held in self._held.items() if not held.is_running]

    def running_ids(self) -> list[int]:
        return [s for s, held in self._held.items() if held.is_running]

    def num_held_pages(self, seq_id: int) -> int:
        return self._pages.num_pages_held(seq_id)

    def evict(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._release(seq_id)

    def step(self, prefill: Sequence[ChunkWork], decode: Sequence[int]) -> StepOutput:
        out = _Recorder()
        cache = self._cache
        for segment in self._plan_prefill(prefill, out):
            held = segment.held
            out.chunks.append((segment.num_tokens, segment.start + held.context_offset))
            self.num_computed_prefill_tokens += segment.num_tokens
            held.num_prefilled = segment.end
            if cache is not None:
                cache.computed(held, segment.end)
            if held.is_running:
                self._emit(held, out)
        self._decode(decode, out)
        self.num_steps += 1
        self.last_step_seconds = self.cost_model.step_seconds(
            StepLoad(tuple(out.chunks), tuple(out.decodes))
        )
        return out.output()

    # Prefill.

    def _plan_prefill(self, prefill: Sequence[ChunkWork], out: _Recorder) -> list[_Segment]:
        """Admit, check and reserve room for every chunk, as ModelEngine plans its packed
        prefill; the prompt tokens each sequence adds this step."""
        planned: dict[int, _Segment] = {}
        for chunk in prefill:
            if chunk.spec is not None:
                self._release(chunk.seq_id)
                self._admit(chunk, out)
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
        return [
            s
            for s in planned.values()
            if s.num_tokens > 0 and self._held.get(s.held.seq_id) is s.held
        ]

    def _admit(self, chunk: ChunkWork, out: _Recorder) -> None:
        """Hold a first chunk's sequence, from its resume point if it names one, in
        ModelEngine's order of checks: the prompt, max_new_tokens, a GDN slot, the cache."""
        seq_id, spec, cached_tokens = chunk.seq_id, chunk.spec, chunk.cached_tokens
        prompt_len = len(spec.prompt_token_ids)
        problem = (
            "the prompt is empty"
            if not prompt_len
            else cached_tokens_problem(cached_tokens, prompt_len, self.cache_block_tokens)
        )
        if problem is not None:
            out.finished.append(FinishedSequence(seq_id, FinishReason.FAILED, 0, problem))
            return
        if spec.max_new_tokens <= 0:
            out.finished.append(FinishedSequence(seq_id, FinishReason.MAX_LENGTH, 0))
            return
        if self.gdn_free_slots() == 0:
            out.preempted.append(seq_id)
            return
        held = _Held(
            seq_id, spec, list(spec.prompt_token_ids), self._num_admissions + 1, prompt_len
        )
        if cached_tokens:
            if (
                self._cache is None
                or not spec.may_resume_from_cache
                or not self._cache.resume(held, cached_tokens)
            ):
                out.cache_misses.append(seq_id)
                return
            held.num_prefilled = cached_tokens
        self._num_admissions += 1
        self._held[seq_id] = held
        if self._imports and spec.prompt_token_ids[0] in self._imports:
            held.context_offset = self._imports[spec.prompt_token_ids[0]]
            self.num_imports_resumed += prompt_len > 1
            self._reserve(held, held.context_offset, out)  # may preempt, or refuse it

    # Decode.

    def _decode(self, decode: Sequence[int], out: _Recorder) -> None:
        held_by_id = self._held
        batch = {s: h for s in decode if (h := held_by_id.get(s)) is not None and h.is_running}
        # Earliest admitted first, as the reference engine reserves: the victims of a page
        # shortage are then the latest admitted, not yet reserved.
        pages, page_size = self._pages, self.page_size
        for held in sorted(batch.values(), key=lambda h: h.admission):
            if held.seq_id in held_by_id:
                if pages.num_tokens(held.seq_id) % page_size:  # room left in its last page
                    pages.append(held.seq_id, 1)
                else:
                    self._reserve(held, 1, out)
        cache = self._cache
        for held in batch.values():
            if held.seq_id in held_by_id:
                # The context before this token.
                out.decodes.append(len(held.token_ids) - 1 + held.context_offset)
                if cache is not None:
                    cache.computed(held, len(held.token_ids))
                self._emit(held, out)

    # Shared.

    def _emit(self, held: _Held, out: _Recorder) -> None:
        held.num_generated += 1
        held.token_ids.append(TOKEN_ID)
        out.tokens.append((held.seq_id, (TOKEN_ID,)))
        if held.num_generated >= held.spec.max_new_tokens:
            self._release(held.seq_id)
            out.finished.append(
                FinishedSequence(held.seq_id, FinishReason.MAX_LENGTH, held.num_generated)
            )

    def _reserve(self, held: _Held, num_tokens: int, out: _Recorder) -> bool:
        """Reserve KV room for num_tokens more tokens, preempting the latest admitted and
        then reclaiming cache; False if `held` itself lost."""
        pages = self._pages
        needed = pages.num_pages_for(pages.num_tokens(held.seq_id) + num_tokens)
        if needed > self.total_kv_pages:
            self._release(held.seq_id)
            out.finished.append(
                FinishedSequence(
                    held.seq_id,
                    FinishReason.FAILED,
                    held.num_generated,
                    f"the sequence needs {needed} KV pages of {self.page_size} tokens, more than "
                    f"the worker's {self.total_kv_pages} in all",
                )
            )
            return False
        num_new_pages = pages.num_new_pages(held.seq_id, num_tokens)
        while num_new_pages > self.kv_free_pages():
            victim = next(
                h
                for h in reversed(self._held.values())
                if h is held or pages.num_pages_held(h.seq_id) > 0
            )
            self._release(victim.seq_id)
            out.preempted.append(victim.seq_id)
            if victim is held:
                return False
        self._append_pages(held.seq_id, num_tokens)
        return True

    def _release(self, seq_id: int) -> None:
        held = self._held.pop(seq_id, None)
        if held is not None:
            self._release_books(held)


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
        return StepOutput(
            tuple(self.tokens),
            tuple(self.finished),
            tuple(self.preempted),
            tuple(self.cache_misses),
        )
