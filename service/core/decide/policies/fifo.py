"""The seed's first-come-first-served scheduler, kept as the simplest policy that
follows docs/contract.md rules 2-7: a batch-size cap and no token budget."""

from __future__ import annotations

from service.core.cache.prefix_cache import align_chunk
from service.core.config import SchedulerConfig
from service.core.decide.plan import Chunk, DecisionView, Plan
from service.core.decide.policies.admit import admit
from service.core.decide.policies.placement import PlacementRule
from service.core.decide.step_budget import StepBudget
from service.core.vocabulary import BlockReason, SequenceView


class FifoPolicy:
    """- capacity = max_batch_size - active, never below 0;
    - each new sequence needs one free GDN slot;
    - the free-page reserve guard blocks admissions unless the batch is empty;
    - prompts go out in chunks of at most chunk_size; every running sequence decodes.
    No token budget and no page accounting: the worker preempts on its own."""

    name = "fifo"
    token_budget = None

    def __init__(self, config: SchedulerConfig) -> None:
        self._chunk_size = config.chunk_size
        self._prefill_reserve_pages = config.prefill_reserve_pages
        self._max_loras = config.max_loras
        self._placement = PlacementRule(config)

    def budget(self, view: DecisionView) -> StepBudget:
        capacity = max(0, view.max_batch_size - view.num_active)
        if view.draining:
            new_seqs, reason = 0, BlockReason.DRAINING
        elif capacity and view.kv_free_pages < self._prefill_reserve_pages and view.num_active:
            # The reserve guard: never starve an empty batch, whatever the page count.
            new_seqs, reason = 0, BlockReason.KV_RESERVE
        else:
            new_seqs, reason = capacity, BlockReason.BATCH_FULL
        return StepBudget(
            new_seqs=new_seqs,
            new_seqs_reason=reason,
            gdn_slots=view.gdn_free_slots,
            decision_bytes=view.decision_bytes,
            page_size=view.page_size,
            max_loras=self._max_loras,
            adapters=set(view.adapters_in_use),
        )

    def plan(self, view: DecisionView) -> Plan:
        block = view.align_block_tokens
        admissions, blocked = admit(
            view,
            self.budget(view),
            lambda seq, budget, cached: align_chunk(cached, self._first_chunk(seq, cached), block),
            self._placement,
        )
        return Plan(
            decode=view.running_ids,
            continuations=tuple(
                Chunk(
                    seq.seq_id,
                    align_chunk(
                        seq.cursor,
                        max(0, min(self._chunk_size, seq.spec_prompt_len() - seq.cursor)),
                        block,
                    ),
                )
                for seq in view.waiting
            ),
            admissions=admissions,
            blocked=blocked,
        )

    def _first_chunk(self, seq: SequenceView, cached: int) -> int:
        # From the worker's resume point when it reported one, ending on a block boundary
        # where one lies inside (docs/prefix-caching.md): a worker that registered no
        # cache gets exactly rule 5's chunks.
        return min(self._chunk_size, seq.num_tokens() - cached)
