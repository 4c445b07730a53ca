"""The `budget` and `fair` policies: a token budget per worker iteration, spent in the
manner of Sarathi-Serve's stall-free batching and vLLM's scheduler (docs/contract.md,
"Policies"):

1. every running sequence decodes, one token of the budget each;
2. if the free pages cannot cover this iteration's decode growth plus the watermark,
   running sequences are preempted, lowest urgency first, until the rest fit;
3. prefills in progress continue, oldest admission first, as far as budget and pages go;
4. new sequences are admitted in queue order while capacity, GDN slots, pages and
   budget last, each with a first chunk of at least min(C, prompt) tokens.

One addition, so that a worker never stalls: when nothing at all could run (no decode,
no chunk) because prefills in progress hold the pages the others need, the latest
admitted of them is preempted; a lone sequence gets its chunk whatever the pages (the
worker then preempts or fails it, as with fifo's empty-batch rule).

`fair` is this batching over the fair queue order (service/core/orders.py): the order
and the batching are chosen apart, so there is no policy class of its own.
"""
from __future__ import annotations

from service.core.config import SchedulerConfig
from service.core.plan import Chunk, DecisionView, Plan
from service.core.policies.admit import admit
from service.core.prefix_cache import align_chunk
from service.core.step_budget import StepBudget, decode_pages, held_pages
from service.core.vocabulary import BlockReason, PreemptReason, SequenceView


class BudgetPolicy:
    """Token-budget batching, over whichever queue order it is given candidates in."""

    name = "budget"

    def __init__(self, config: SchedulerConfig) -> None:
        self._config = config
        self.token_budget = config.token_budget
        self._min_prefill_chunk = config.first_chunk_floor

    def budget(self, view: DecisionView) -> StepBudget:
        if view.draining:
            new_seqs, reason = 0, BlockReason.DRAINING
        else:
            new_seqs, reason = max(0, view.max_batch_size - view.num_active), BlockReason.BATCH_FULL
        watermark = self._config.kv_watermark(view.total_kv_pages)
        return StepBudget(new_seqs=new_seqs, new_seqs_reason=reason,
                          gdn_slots=view.gdn_free_slots, decision_bytes=view.decision_bytes,
                          page_size=view.page_size, tokens=self.token_budget,
                          kv_pages=view.kv_free_pages - watermark,
                          max_loras=self._config.max_loras, adapters=set(view.adapters_in_use))

    def plan(self, view: DecisionView) -> Plan:
        budget = self.budget(view)
        growth = [decode_pages(seq, budget.page_size) for seq in view.running]
        preempt = _preempt_for_growth(view, budget, growth)
        decode = []
        for seq, new_pages in zip(view.running, growth):
            if seq.seq_id not in preempt:
                decode.append(seq.seq_id)
                budget.take_decode(new_pages)
        decode = tuple(decode)
        continuations = _continue_prefills(view, budget)
        admissions, blocked = admit(
            view, budget,
            lambda seq, left, cached: self._first_chunk(seq, left, cached,
                                                        view.cache_block_tokens))
        if not (decode or continuations or admissions or preempt):
            stuck = _unstick(view, budget)
            if stuck is not None:
                return stuck
        return Plan(decode=decode, continuations=continuations, admissions=admissions,
                    preempt=tuple(preempt), preempt_reason=PreemptReason.KV_GROWTH,
                    blocked=blocked)

    def _first_chunk(self, seq: SequenceView, budget: StepBudget, cached: int,
                     block_tokens: int) -> int | None:
        """Tokens after the `cached` ones, within the budget, ending on a block where
        the budget allows (computed tokens only count against the budget and floor)."""
        prompt_len = seq.num_tokens() - cached
        floor = min(self._min_prefill_chunk, prompt_len)
        length = min(prompt_len, budget.tokens)
        aligned = align_chunk(cached, length, block_tokens)
        if aligned >= floor:
            return aligned
        return length if length >= floor else None


def _preempt_for_growth(view: DecisionView, budget: StepBudget,
                        growth: list[int]) -> dict[int, None]:
    """Step 2: running sequences to preempt so that this iteration's decodes (`growth`:
    new pages of each) fit in the free pages less the watermark (a victim's pages count
    as freed), in victim order."""
    need = sum(growth)
    victims: dict[int, None] = {}
    if need == 0 or budget.kv_pages >= need:
        return victims
    # Lowest urgency first: the highest priority value, then the latest admitted.
    ranked = sorted(zip(view.running, growth),
                    key=lambda pair: (pair[0].priority, pair[0].admission_order), reverse=True)
    for seq, new_pages in ranked:
        victims[seq.seq_id] = None
        need -= new_pages
        budget.give_back(held_pages(seq, budget.page_size, running=True))
        if need == 0 or budget.kv_pages >= need:
            break
    return victims


def _continue_prefills(view: DecisionView, budget: StepBudget) -> tuple[Chunk, ...]:
    """Step 3: the next chunk of each prefill in progress, oldest admission first."""
    chunks = []
    for seq in sorted(view.waiting, key=lambda s: s.admission_order):
        if budget.tokens <= 0:
            break
        length = align_chunk(seq.cursor,
                             budget.max_chunk(seq.cursor, seq.spec_prompt_len() - seq.cursor),
                             view.cache_block_tokens)
        if length > 0:
            budget.take_chunk(seq.cursor, length)
            view.service.charge(seq.tenant, length)
            chunks.append(Chunk(seq.seq_id, length))
    return tuple(chunks)


def _unstick(view: DecisionView, budget: StepBudget) -> Plan | None:
    """The plan when nothing could run: prefills in progress wait for pages that only
    they hold. None when nothing is stuck (the worker is idle, or waits on the queue)."""
    stuck = [seq for seq in view.waiting if seq.spec_prompt_len() > seq.cursor]
    if not stuck:
        return None
    if view.num_active == 1:
        seq = stuck[0]
        length = min(seq.spec_prompt_len() - seq.cursor, budget.tokens)
        view.service.charge(seq.tenant, length)
        return Plan(continuations=(Chunk(seq.seq_id, length),))
    victim = max(view.waiting, key=lambda s: (s.priority, s.admission_order))
    return Plan(preempt=(victim.seq_id,), preempt_reason=PreemptReason.NO_PROGRESS)
