"""ModelEngine: the reference implementation of api.Engine on a Qwen3.5 model."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from .api import (
    ChunkWork,
    FinishReason,
    ImportProblem,
    ImportRefused,
    SequenceSpec,
    StateChunk,
    StepOutput,
    TokenLogprobs,
)
from .batch import PackedBatch
from .books import CacheBooks
from .handoff import export_state, parse_chunks, write_state
from .kv_cache import PagedKVCache
from .model import Qwen35ForCausalLM
from .paged_forward_cache import PagedForwardCache
from .prefix_cache import cached_tokens_problem
from .sampling import SamplingParams, sample_token, token_logprobs
from .sequence import HeldSequence, PrefillSegment, StepRecorder
from .sizing import PoolSizes, check_pools_fit, default_pool_sizes
from .state_pool import GdnStatePool

__all__ = ["ModelEngine", "default_pool_sizes"]

# Padded tokens (rows x longest row) of one packed prefill forward: bounds its activations
# (the attention scores of a row are its chunk x its context) while packing a step's chunks.
DEFAULT_MAX_PREFILL_TOKENS = 8192


class ModelEngine(CacheBooks):
    """Runs scheduler decisions on a model with a paged KV cache and a GDN state pool.

    `step` first runs the prefill chunks, packed into one forward (several when
    they are from more than `max_prefill_sequences` sequences or would pad to more
    than `max_prefill_tokens`), then one batched
    decode forward over the running sequences named (split into forwards of at
    most `max_batch_size` rows). Chunks are read in order: ids the engine does
    not hold and chunks of length 0 are ignored; a chunk overlapping what is
    already prefilled (or planned this step) adds only its new tokens; a chunk
    starting past it (a lost decision) preempts the sequence. When pages run
    out, the latest admitted sequence that holds pages (possibly the one being
    extended) is preempted, and its chunks planned this step are dropped; a
    chunk with a spec that finds no free GDN slot is preempted too. A sequence
    that could not fit even in the whole pool, or whose prompt is empty or out
    of the vocabulary, finishes FAILED. A sequence can appear in `tokens` and
    `preempted` in the same step (it sampled in prefill, then lost its pages in decode).

    With `cache_block_tokens` > 0 the engine keeps a prefix cache (prefix_cache.py: the
    books, what counts as free): a first chunk with `cached_tokens` starts from a resume
    point, or is a cache miss when that point is gone (nothing runs for it). A
    `cached_tokens` that is not a multiple of the block below the prompt's length
    finishes the sequence FAILED.
    """

    _pages: PagedKVCache  # the books' page tables, with the K/V tensors
    can_hand_off = True

    def __init__(
        self,
        model: Qwen35ForCausalLM,
        *,
        total_kv_pages: int,
        page_size: int,
        total_gdn_slots: int,
        device: str | torch.device,
        max_batch_size: int | None = None,
        max_prefill_sequences: int | None = None,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        cache_block_tokens: int = 0,
        total_snapshot_slots: int = 0,
        max_cached_blocks: int | None = None,
    ) -> None:
        """Allocates the pools on `device` (the model must be there); raises ModelDoesNotFit.

        `max_batch_size` (default: total_gdn_slots) bounds the rows of a decode forward,
        `max_prefill_sequences` (default: max_batch_size) the sequences packed into one
        prefill forward (1: one forward per sequence's chunk), and `max_prefill_tokens`
        its padded size, rows x longest row (a longer single chunk still runs, alone).
        `cache_block_tokens` (a multiple of page_size; 0 = no prefix cache) and
        `total_snapshot_slots` (ignored for a model without GDN layers) size the prefix
        cache; `max_cached_blocks` bounds the cached blocks no held sequence uses (None:
        as many as the free pages hold).
        """
        limits = (
            total_kv_pages,
            page_size,
            total_gdn_slots,
            max_batch_size or 1,
            max_prefill_sequences or 1,
            max_prefill_tokens,
        )
        if min(limits) < 1:
            raise ValueError(
                "total_kv_pages, page_size, total_gdn_slots, max_batch_size, "
                "max_prefill_sequences and max_prefill_tokens must be >= 1"
            )
        self.device = torch.device(device)
        config = model.config
        self.model = model
        self.page_size = page_size
        self.total_kv_pages = total_kv_pages
        self.total_gdn_slots = total_gdn_slots
        self.max_batch_size = max_batch_size or total_gdn_slots
        self.max_prefill_sequences = max_prefill_sequences or self.max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        dtype = model.dtype
        if config.num_linear_attention_layers == 0 or cache_block_tokens == 0:
            total_snapshot_slots = 0
        self.cache_block_tokens = cache_block_tokens
        self.total_snapshot_slots = total_snapshot_slots
        check_pools_fit(
            config,
            PoolSizes(total_kv_pages, page_size, total_gdn_slots, total_snapshot_slots),
            self.device,
            dtype,
        )
        kv_cache = PagedKVCache(
            num_layers=config.num_full_attention_layers,
            num_pages=total_kv_pages,
            page_size=page_size,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            device=self.device,
            dtype=dtype,
        )
        self._state_pool = GdnStatePool(
            num_layers=config.num_linear_attention_layers,
            num_slots=total_gdn_slots,
            conv_dim=config.linear_conv_dim,
            conv_kernel=config.linear_conv_kernel_dim,
            num_value_heads=config.linear_num_value_heads,
            key_head_dim=config.linear_key_head_dim,
            value_head_dim=config.linear_value_head_dim,
            device=self.device,
            dtype=dtype,
        )
        self._keep_books(
            kv_cache,
            cache_block_tokens=cache_block_tokens,
            snapshot_slots=total_snapshot_slots,
            needs_snapshots=config.num_linear_attention_layers > 0,
            max_unused_blocks=max_cached_blocks,
            states=self._state_pool,
        )
        self._held: dict[int, HeldSequence] = {}  # in admission order
        self._num_admissions = 0
        # What a handoff moves (export_sequence's chunks, less their framing).
        self.handoff_bytes_per_token = float(
            PagedKVCache.bytes_per_page(
                config.num_full_attention_layers,
                1,
                config.num_key_value_heads,
                config.head_dim,
                dtype,
            )
        )
        self.handoff_fixed_bytes = float(
            GdnStatePool.bytes_per_slot(
                config.num_linear_attention_layers,
                config.linear_conv_dim,
                config.linear_conv_kernel_dim,
                config.linear_num_value_heads,
                config.linear_key_head_dim,
                config.linear_value_head_dim,
                dtype,
            )
        )

    def gdn_free_slots(self) -> int:
        return self._state_pool.num_free_slots()

    def waiting_ids(self) -> list[int]:
        return [s for s, held in self._held.items() if not held.is_running]

    def running_ids(self) -> list[int]:
        return [s for s, held in self._held.items() if held.is_running]

    def evict(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._release(seq_id)

    def step(self, prefill: Sequence[ChunkWork], decode: Sequence[int]) -> StepOutput:
        recorder = StepRecorder()
        with torch.inference_mode():
            self._prefill(self._plan_prefill(prefill, recorder), recorder)
            self._decode(decode, recorder)
        return recorder.output()

    # Handoffs.

    def export_sequence(self, seq_id: int, first_token: int = 0) -> tuple[StateChunk, ...] | None:
        held = self._held.get(seq_id)
        if held is None or not held.is_running:
            return None
        num_tokens = len(held.token_ids) - 1  # the last is fed by the next decode
        with torch.inference_mode():
            return export_state(
                self._pages, self._state_pool, seq_id, held.slot, first_token, num_tokens
            )

    def import_sequence(
        self,
        seq_id: int,
        spec: SequenceSpec,
        chunks: Iterable[StateChunk],
        cached_tokens: int = 0,
    ) -> None:
        num_tokens = len(spec.prompt_token_ids) - 1
        problem = _prompt_problem(spec.prompt_token_ids, self.model.config.vocab_size)
        if problem is None and spec.max_new_tokens <= 0:
            problem = "nothing left to generate (max_new_tokens 0)"
        if problem is None and num_tokens < 1:
            problem = "a handoff needs a prompt of at least 2 tokens"
        if problem is None:
            problem = cached_tokens_problem(
                cached_tokens, len(spec.prompt_token_ids), self.cache_block_tokens
            )
        if problem is None and seq_id in self._held:
            # Refused before anything is freed: what it holds stays as it was.
            problem = f"sequence {seq_id} is held already; evict it before importing it"
        if problem is not None:
            raise ImportRefused(ImportProblem.INVALID, problem)
        with torch.inference_mode():
            parsed = parse_chunks(self._pages, self._state_pool, chunks, cached_tokens, num_tokens)
            held = self._hold_imported(seq_id, spec, cached_tokens, num_tokens)
            try:
                write_state(self._pages, self._state_pool, seq_id, held.slot, parsed)
            except BaseException:
                self._release_books(held)  # its pages and slot back, nothing held
                self._state_pool.release(held.slot)
                raise
        held.num_prefilled = held.prompt_len
        self._held[seq_id] = held
        if self._cache is not None:
            self._cache.computed(held, num_tokens)

    def _hold_imported(
        self, seq_id: int, spec: SequenceSpec, cached_tokens: int, num_tokens: int
    ) -> HeldSequence:
        """A slot and pages for an imported sequence (its cached blocks mapped), not yet
        in `_held`; raises ImportRefused, holding nothing, when they are short."""
        slot = self._state_pool.acquire()
        if slot is None:
            raise ImportRefused(ImportProblem.NO_ROOM, "no free GDN state slot")
        self._num_admissions += 1
        held = HeldSequence(
            seq_id=seq_id,
            spec=spec,
            slot=slot,
            admission=self._num_admissions,
            sampling=SamplingParams.from_spec(spec),
            token_ids=list(spec.prompt_token_ids),
        )
        if cached_tokens and (
            self._cache is None
            or not spec.may_resume_from_cache
            or not self._cache.resume(held, cached_tokens)
        ):
            self._state_pool.release(slot)
            raise ImportRefused(
                ImportProblem.CACHE_MISS, f"the resume point at {cached_tokens} tokens is gone"
            )
        num_new_pages = self._pages.num_new_pages(seq_id, num_tokens - cached_tokens)
        if num_new_pages > self.kv_free_pages():
            self._release_books(held)
            self._state_pool.release(slot)
            raise ImportRefused(
                ImportProblem.NO_ROOM,
                f"{num_new_pages} KV pages needed, {self.kv_free_pages()} free",
            )
        self._append_pages(seq_id, num_tokens - cached_tokens)
        return held

    # Prefill.

    def _plan_prefill(
        self, prefill: Sequence[ChunkWork], recorder: StepRecorder
    ) -> list[PrefillSegment]:
        """Admit, check and reserve KV room for every chunk; the prompt tokens each sequence adds this step."""
        planned: dict[int, PrefillSegment] = {}
        for chunk in prefill:
            if chunk.spec is not None:
                self._release(chunk.seq_id)
                self._admit(chunk.seq_id, chunk.spec, chunk.cached_tokens, recorder)
            held = self._held.get(chunk.seq_id)
            if held is None or held.is_running:
                continue
            segment = planned.get(chunk.seq_id)
            if (
                segment is None or segment.held is not held
            ):  # nothing yet, or planned for a restarted one
                segment = planned[chunk.seq_id] = PrefillSegment(held, held.num_prefilled, 0)
            if chunk.chunk_start > segment.end:
                # A decision was lost on the way: give the sequence back rather than prefill around a gap.
                self._release(held.seq_id)
                recorder.preempt(held.seq_id)
                continue
            # A chunk overlapping what is already prefilled (a retransmission) only adds its new part.
            num_tokens = min(chunk.chunk_start + chunk.chunk_len, held.prompt_len) - segment.end
            if num_tokens > 0 and self._reserve(held, num_tokens, recorder):
                segment.num_tokens += num_tokens
        # Sequences released while planning (preempted by a later chunk, restarted) run nothing.
        return [
            s
            for s in planned.values()
            if s.num_tokens > 0 and self._held.get(s.held.seq_id) is s.held
        ]

    def _prefill(self, segments: list[PrefillSegment], recorder: StepRecorder) -> None:
        """Run the planned tokens, packed; sample the first token of every prompt completed."""
        for group in self._prefill_groups(segments):
            token_ids = [t for s in group for t in s.held.token_ids[s.start : s.end]]
            positions = [p for s in group for p in range(s.start, s.end)]
            logit_rows = _logit_rows(group)
            logits = self._forward(
                [s.held for s in group],
                token_ids,
                [s.num_tokens for s in group],
                positions,
                logit_rows,
            )
            first = 0  # this segment's first row of `logits`
            for row, segment in enumerate(group):
                held = segment.held
                held.num_prefilled = segment.end
                num_rows = 1 if logit_rows is None else len(logit_rows[row])
                segment_logits = logits[first : first + num_rows]
                first += num_rows
                if held.spec.needs_all_prompt_logits:
                    self._keep_prompt_logprobs(held, segment, segment_logits)
                if self._cache is not None:
                    self._cache.computed(held, segment.end)
                if held.is_running:
                    if held.spec.needs_all_prompt_logits:
                        recorder.prompt(held.seq_id, held.prompt_logprobs)
                    self._emit(held, segment_logits[-1], recorder)

    def _keep_prompt_logprobs(
        self, held: HeldSequence, segment: PrefillSegment, logits: torch.Tensor
    ) -> None:
        """Add the log-probabilities of the prompt tokens this segment's logits predict
        (position p's logits predict token p + 1; the last prompt position's predict the
        first generated token, not a prompt token)."""
        num_predicted = min(segment.end, held.prompt_len - 1) - segment.start
        if num_predicted <= 0:
            return
        targets = torch.tensor(
            held.token_ids[segment.start + 1 : segment.start + 1 + num_predicted]
        )
        held.prompt_logprobs.extend(
            token_logprobs(logits[:num_predicted], targets, held.spec.prompt_logprobs)
        )

    def _admit(
        self, seq_id: int, spec: SequenceSpec, cached_tokens: int, recorder: StepRecorder
    ) -> None:
        problem = _prompt_problem(
            spec.prompt_token_ids, self.model.config.vocab_size
        ) or cached_tokens_problem(
            cached_tokens, len(spec.prompt_token_ids), self.cache_block_tokens
        )
        if problem is not None:
            recorder.finish(seq_id, FinishReason.FAILED, 0, problem)
            return
        if spec.max_new_tokens <= 0:
            recorder.finish(seq_id, FinishReason.MAX_LENGTH, 0)
            return
        slot = self._state_pool.acquire()
        if slot is None:
            recorder.preempt(seq_id)
            return
        held = HeldSequence(
            seq_id=seq_id,
            spec=spec,
            slot=slot,
            admission=self._num_admissions + 1,
            sampling=SamplingParams.from_spec(spec),
            token_ids=list(spec.prompt_token_ids),
        )
        if cached_tokens:
            if (
                self._cache is None
                or not spec.may_resume_from_cache
                or not self._cache.resume(held, cached_tokens)
            ):
                self._state_pool.release(slot)
                recorder.cache_miss(seq_id)
                return
            held.num_prefilled = cached_tokens
        self._num_admissions += 1
        self._held[seq_id] = held

    def _prefill_groups(self, segments: list[PrefillSegment]) -> Iterator[list[PrefillSegment]]:
        """Consecutive segments in groups within max_prefill_sequences and max_prefill_tokens (padded)."""
        group: list[PrefillSegment] = []
        longest = 0
        for segment in segments:
            longest_with = max(longest, segment.num_tokens)
            if group and (
                len(group) == self.max_prefill_sequences
                or (len(group) + 1) * longest_with > self.max_prefill_tokens
            ):
                yield group
                group, longest_with = [], segment.num_tokens
            group.append(segment)
            longest = longest_with
        if group:
            yield group

    # Decode.

    def _decode(self, decode: Sequence[int], recorder: StepRecorder) -> None:
        batch = {s: self._held[s] for s in decode if s in self._held and self._held[s].is_running}
        # Earliest admitted first: the victims of a page shortage are then not yet reserved.
        for held in sorted(batch.values(), key=lambda h: h.admission):
            if held.seq_id in self._held:
                self._reserve(held, 1, recorder)
        running = [held for held in batch.values() if held.seq_id in self._held]
        for first in range(0, len(running), self.max_batch_size):
            group = running[first : first + self.max_batch_size]
            token_ids = [h.token_ids[-1] for h in group]
            positions = [len(h.token_ids) - 1 for h in group]
            logits = self._forward(group, token_ids, [1] * len(group), positions)
            for row, held in enumerate(group):
                if self._cache is not None:
                    self._cache.computed(held, len(held.token_ids))
                self._emit(held, logits[row], recorder)

    # Shared.

    def _forward(
        self,
        group: list[HeldSequence],
        token_ids: list[int],
        seq_lens: list[int],
        positions: list[int],
        logit_rows: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """Logits [rows, vocab] of each row's last token; row i has seq_lens[i] packed tokens. Caches updated in place.

        With `logit_rows` (per row, the packed token indices whose logits are wanted, ending
        with its last), the logits of those tokens, all rows' end to end."""
        batch = PackedBatch(seq_lens, torch.tensor(positions, device=self.device))
        cache = PagedForwardCache(
            self._pages, self._state_pool, [h.seq_id for h in group], [h.slot for h in group], batch
        )
        index = None
        if logit_rows is not None:
            index = torch.tensor([i for rows in logit_rows for i in rows], device=self.device)
        return self.model.forward_packed(
            torch.tensor(token_ids, device=self.device),
            batch,
            cache,
            last_only=True,
            logit_index=index,
        )

    def _emit(self, held: HeldSequence, logits: torch.Tensor, recorder: StepRecorder) -> None:
        """Sample the next token of `held`, report it, and finish the sequence if it ends here."""
        token_id = sample_token(logits, held.sampling, position=len(held.token_ids))
        logprobs: TokenLogprobs | None = None
        if held.spec.logprobs > 0:
            logprobs = token_logprobs(
                logits.unsqueeze(0), torch.tensor([token_id]), held.spec.logprobs
            )[0]
        held.token_ids.append(token_id)
        held.num_generated += 1
        recorder.token(held.seq_id, token_id, logprobs)
        reason = held.finish_reason(token_id, self.model.config.eos_token_ids)
        if reason is not None:
            self._release(held.seq_id)
            recorder.finish(held.seq_id, reason, held.num_generated)

    def _reserve(self, held: HeldSequence, num_tokens: int, recorder: StepRecorder) -> bool:
        """Reserve KV room for `num_tokens` more tokens, preempting others; False if `held` itself lost."""
        kv = self._pages
        num_pages_needed = kv.num_pages_for(kv.num_tokens(held.seq_id) + num_tokens)
        if num_pages_needed > kv.num_pages:
            self._release(held.seq_id)
            recorder.finish(
                held.seq_id,
                FinishReason.FAILED,
                held.num_generated,
                f"the sequence needs {num_pages_needed} KV pages of {kv.page_size} tokens, "
                f"more than the worker's {kv.num_pages} in all",
            )
            return False
        num_new_pages = kv.num_new_pages(held.seq_id, num_tokens)
        while num_new_pages > self.kv_free_pages():
            victim = max(
                (h for h in self._held.values() if h is held or kv.num_pages_held(h.seq_id) > 0),
                key=lambda h: h.admission,
            )
            self._release(victim.seq_id)
            recorder.preempt(victim.seq_id)
            if victim is held:
                return False
        self._append_pages(held.seq_id, num_tokens)
        return True

    def _release(self, seq_id: int) -> None:
        """Forget `seq_id` and free its pages and slot; unknown ids are ignored."""
        held = self._held.pop(seq_id, None)
        if held is None:
            return
        self._release_books(held)
        self._state_pool.release(held.slot)


def _logit_rows(group: list[PrefillSegment]) -> list[list[int]] | None:
    """Per segment, the packed token indices whose logits the step needs: every one of a
    sequence that reports prompt log-probabilities, the last of the others; None when
    every segment needs only its last (the usual, cheaper forward)."""
    if not any(s.held.spec.needs_all_prompt_logits for s in group):
        return None
    rows, start = [], 0
    for segment in group:
        end = start + segment.num_tokens
        rows.append(
            list(range(start, end)) if segment.held.spec.needs_all_prompt_logits else [end - 1]
        )
        start = end
    return rows


def _prompt_problem(prompt_token_ids: Sequence[int], vocab_size: int) -> str | None:
    """Why the engine cannot run this prompt, or None (checked before it runs)."""
    if not prompt_token_ids:
        return "the prompt is empty"
    for token_id in prompt_token_ids:
        if not 0 <= token_id < vocab_size:
            return f"token id {token_id} is outside the model's vocabulary of {vocab_size}"
    return None
