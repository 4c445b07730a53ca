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

`fair` is this batching over the fair queue order (service/core/decide/orders.py): the order
and the batching are chosen apart, so there is no policy class of its own.

The budget B is --max-num-batched-tokens, or, with a TPOT target, chosen per decision
from the worker's learned step time (service/core/learn/step_model.py): B = the decodes plus
the most prefill tokens whose predicted step, with those decodes and their context,
takes at most target x (1 - margin), the margin being the model's recent relative error
(within [MIN_MARGIN, MAX_MARGIN]). Never fewer prefill tokens than one first chunk
(--min-prefill-chunk), so that prefill keeps moving when the decodes alone take the
target; never more tokens in all than --max-num-batched-tokens when it is set, else
MAX_LEARNED_TOKEN_BUDGET.

A worker that registers `max_step_tokens` (its engine's own limit per step, as a vLLM
worker does) gets a budget of at most that, fixed or learned; without a configured
--max-num-batched-tokens its fixed budget is that limit (what its engine would batch).
"""

from __future__ import annotations

import math

from service.core.cache.prefix_cache import align_chunk
from service.core.config import SchedulerConfig
from service.core.decide.plan import Chunk, DecisionView, Plan
from service.core.decide.policies.admit import admit
from service.core.decide.policies.placement import PlacementRule
from service.core.decide.step_budget import StepBudget, decode_pages, held_pages
from service.core.learn.step_model import StepTimeModel
from service.core.vocabulary import BlockReason, PreemptReason, SequenceView

# The most tokens a learned budget may give one decision without --max-num-batched-tokens.
MAX_LEARNED_TOKEN_BUDGET = 16384
# The share of the TPOT target kept back for the model's error: its recent relative
# error, at least MIN_MARGIN (a model that fits perfectly still sees noise), at most
# MAX_MARGIN (a model still learning must not starve prefill).
MIN_MARGIN = 0.05
MAX_MARGIN = 0.5
# A learned budget of 2 x TOKEN_ALIGNMENT or more is rounded down to a multiple of
# TOKEN_ALIGNMENT: a step's cost jumps where its token count crosses a GEMM tile or
# CUDA-graph size (the A30 profile: 512 tokens take 72 ms, 519 take 79 ms), which a
# linear model does not see. Between TOKEN_ALIGNMENT and twice that, rounding down to
# TOKEN_ALIGNMENT would cut up to half the budget: there it is rounded down to a multiple
# of FINE_ALIGNMENT (424 tokens become 416, not 256).
TOKEN_ALIGNMENT = 256
FINE_ALIGNMENT = 32


class BudgetPolicy:
    """Token-budget batching, over whichever queue order it is given candidates in."""

    name = "budget"

    def __init__(self, config: SchedulerConfig) -> None:
        self._config = config
        self._min_prefill_chunk = config.first_chunk_floor
        self._tpot_seconds = config.tpot_target_ms / 1000.0
        self._tokens_of: tuple[DecisionView | None, int] = (None, 0)  # the last view's
        self._placement = PlacementRule(config)
        if self._tpot_seconds:
            self.token_budget = config.max_num_batched_tokens or MAX_LEARNED_TOKEN_BUDGET
        else:
            self.token_budget = config.token_budget

    def tokens(self, view: DecisionView) -> int:
        """This decision's token budget: the fixed one, or the TPOT target's (worked out
        once per view: the mechanism asks again to check the plan)."""
        model = view.step_model
        if not self._tpot_seconds or model is None:
            return self._worker_budget(view.max_step_tokens)
        if self._tokens_of[0] is view:
            return self._tokens_of[1]
        tokens = self._learned_tokens(view, model)
        self._tokens_of = (view, tokens)
        return tokens

    def _worker_budget(self, max_step_tokens: int) -> int:
        """The budget (or a learned budget's cap) for a worker whose engine runs at most
        `max_step_tokens` in a step (0: no limit): never more than that, and that when
        no budget is configured (the engine's own batch, not the default)."""
        if not max_step_tokens:
            return self.token_budget
        if self._config.max_num_batched_tokens or self._tpot_seconds:
            return min(self.token_budget, max_step_tokens)
        return max_step_tokens

    def _learned_tokens(self, view: DecisionView, model: StepTimeModel) -> int:
        cap = self._worker_budget(view.max_step_tokens)
        running, waiting = view.running, view.waiting
        margin = min(MAX_MARGIN, max(MIN_MARGIN, model.recent_error))
        prefill = model.prefill_budget(
            self._tpot_seconds * (1.0 - margin),
            num_decodes=len(running),
            decode_context=view.running_context,
            prefill_context=(sum(seq.cursor for seq in waiting) / len(waiting) if waiting else 0.0),
        )
        prefill = max(self._min_prefill_chunk, min(prefill, cap))
        tokens = len(running) + math.floor(prefill)
        return min(cap, max(_rounded(tokens), len(running) + self._min_prefill_chunk))

    def step_tokens(self, model: StepTimeModel) -> int:
        """Prefill tokens of a step of this policy's budget, alone on the worker (what
        the deadline estimate counts a step as)."""
        if not self._tpot_seconds:
            return self.token_budget
        prefill = model.prefill_budget(
            self._tpot_seconds * (1.0 - MIN_MARGIN),
            num_decodes=0,
            decode_context=0,
            prefill_context=0.0,
        )
        return math.floor(max(self._min_prefill_chunk, min(prefill, self.token_budget)))

    def budget(self, view: DecisionView) -> StepBudget:
        if view.draining:
            new_seqs, reason = 0, BlockReason.DRAINING
        else:
            new_seqs, reason = max(0, view.max_batch_size - view.num_active), BlockReason.BATCH_FULL
        watermark = self._config.kv_watermark(view.total_kv_pages)
        return StepBudget(
            new_seqs=new_seqs,
            new_seqs_reason=reason,
            gdn_slots=view.gdn_free_slots,
            decision_bytes=view.decision_bytes,
            page_size=view.page_size,
            tokens=self.tokens(view),
            kv_pages=view.kv_free_pages - watermark,
            max_loras=self._config.max_loras,
            adapters=set(view.adapters_in_use),
        )

    def plan(self, view: DecisionView) -> Plan:
        budget = self.budget(view)
        preempt = _preempt_for_growth(view, budget)
        if preempt:
            decode = tuple(seq_id for seq_id in view.running_ids if seq_id not in preempt)
            new_pages = view.decode_pages - sum(
                decode_pages(seq, budget.page_size) for seq in view.running if seq.seq_id in preempt
            )
        else:
            decode, new_pages = view.running_ids, view.decode_pages
        budget.take_decodes(len(decode), new_pages)
        continuations = _continue_prefills(view, budget)
        admissions, blocked = admit(
            view,
            budget,
            lambda seq, left, cached: self._first_chunk(seq, left, cached, view.align_block_tokens),
            self._placement,
        )
        if not (decode or continuations or admissions or preempt):
            stuck = _unstick(view, budget)
            if stuck is not None:
                return stuck
        return Plan(
            decode=decode,
            continuations=continuations,
            admissions=admissions,
            preempt=tuple(preempt),
            preempt_reason=PreemptReason.KV_GROWTH,
            blocked=blocked,
        )

    def _first_chunk(
        self, seq: SequenceView, budget: StepBudget, cached: int, block_tokens: int
    ) -> int | None:
        """Tokens after the `cached` ones, within the budget, ending on a block where
        the budget allows (computed tokens only count against the budget and floor)."""
        prompt_len = seq.num_tokens() - cached
        floor = min(self._min_prefill_chunk, prompt_len)
        length = min(prompt_len, budget.tokens)
        aligned = align_chunk(cached, length, block_tokens)
        if aligned >= floor:
            return aligned
        if length < floor:
            return None
        # A boundary lies inside: on a worker that aligns, the chunk still ends on it
        # (below the floor: an engine such as vLLM in its align mode runs no other).
        return aligned if block_tokens else length


def _rounded(tokens: int) -> int:
    """`tokens` rounded down: to a multiple of TOKEN_ALIGNMENT from twice that up, to a
    multiple of FINE_ALIGNMENT above TOKEN_ALIGNMENT, not at all up to it."""
    if tokens <= TOKEN_ALIGNMENT:
        return tokens
    if tokens < 2 * TOKEN_ALIGNMENT:
        return tokens // FINE_ALIGNMENT * FINE_ALIGNMENT
    return tokens // TOKEN_ALIGNMENT * TOKEN_ALIGNMENT


def _preempt_for_growth(view: DecisionView, budget: StepBudget) -> dict[int, None]:
    """Step 2: running sequences to preempt so that this iteration's decodes (the view's
    `decode_pages`) fit in the free pages less the watermark (a victim's pages count
    as freed), in victim order."""
    need = view.decode_pages
    victims: dict[int, None] = {}
    if need == 0 or budget.kv_pages >= need:
        return victims
    # Lowest urgency first: the highest priority value, then the latest admitted.
    page_size = budget.page_size
    ranked = sorted(
        ((seq, decode_pages(seq, page_size)) for seq in view.running),
        key=lambda pair: (pair[0].priority, pair[0].admission_order),
        reverse=True,
    )
    for seq, new_pages in ranked:
        victims[seq.seq_id] = None
        need -= new_pages
        budget.give_back(held_pages(seq, page_size, running=True))
        if need == 0 or budget.kv_pages >= need:
            break
    return victims


def _continue_prefills(view: DecisionView, budget: StepBudget) -> tuple[Chunk, ...]:
    """Step 3: the next chunk of each prefill in progress, oldest admission first."""
    chunks = []
    for seq in sorted(view.waiting, key=lambda s: s.admission_order):
        if budget.tokens <= 0:
            break
        length = align_chunk(
            seq.cursor,
            budget.max_chunk(seq.cursor, seq.spec_prompt_len() - seq.cursor),
            view.align_block_tokens,
        )
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
        length = align_chunk(
            seq.cursor,
            min(seq.spec_prompt_len() - seq.cursor, budget.tokens),
            view.align_block_tokens,
        )
        view.service.charge(seq.tenant, length)
        return Plan(continuations=(Chunk(seq.seq_id, length),))
    victim = max(view.waiting, key=lambda s: (s.priority, s.admission_order))
    return Plan(preempt=(victim.seq_id,), preempt_reason=PreemptReason.NO_PROGRESS)
