"""Admissions from the queue, in the queue order: the loop every policy shares."""

from __future__ import annotations

from collections.abc import Callable

from service.core.decide.plan import Chunk, DecisionView
from service.core.decide.policies.placement import PlacementRule
from service.core.decide.step_budget import StepBudget
from service.core.vocabulary import BlockReason, SequenceView

# Candidates one decision may pass over (adapter limits, too big for what is left)
# before it stops looking: a decision costs O(admissions + this), never O(queue).
MAX_SKIPPED = 256

# The first chunk's length for a candidate, given what is left and how many of its prompt
# tokens the worker has cached (the chunk starts there); None: it does not fit.
FirstChunk = Callable[[SequenceView, StepBudget, int], "int | None"]


def admit(
    view: DecisionView,
    budget: StepBudget,
    first_chunk: FirstChunk,
    placement_rule: PlacementRule | None = None,
) -> tuple[tuple[Chunk, ...], BlockReason | None]:
    """Admit candidates in queue order while the budget lasts (with a fleet view, in
    the placement's order, less those it defers to a better placed worker). A candidate
    that does not fit is skipped, not waited for: later ones that fit go ahead of it.
    Returns the admissions and what stopped them (None: the queue ran out first, nothing
    skipped; the caller reports a reason only while sequences are still queued)."""
    admissions: list[Chunk] = []
    blocked = _stop_reason(budget)
    if blocked is not None:
        return (), blocked  # without ordering the queue (a full batch is the common case)
    placement = placement_rule.start(view) if placement_rule is not None else None
    num_skipped = 0
    for seq in view.queue() if placement is None else placement.candidates():
        stop = _stop_reason(budget)
        if stop is not None:
            blocked = stop
            break
        if placement is None:
            deferred, passed = False, None
        else:
            deferred, passed = placement.place(seq, len(admissions))
        if deferred:
            blocked = BlockReason.PLACEMENT
        elif budget.fits_adapter(seq.adapter_id):
            cached = view.cached_tokens(seq)
            length = first_chunk(seq, budget, cached)
            reason = (
                BlockReason.TOKEN_BUDGET
                if length is None
                else budget.admission_blocker(seq, length, cached)
            )
            if reason is None:
                if placement is not None and passed is None:
                    passed = placement.overdue_pass(seq)
                budget.take_admission(seq, length, cached)
                view.service.charge(seq.tenant, length)
                admissions.append(Chunk(seq.seq_id, length, cached, passed))
                continue
            blocked = reason
        num_skipped += 1
        if num_skipped >= MAX_SKIPPED:
            break
    return tuple(admissions), blocked


def _stop_reason(budget: StepBudget) -> BlockReason | None:
    """Why nothing more can be admitted, whatever the candidate; None if something can."""
    if budget.new_seqs <= 0:
        return budget.new_seqs_reason
    if budget.gdn_slots <= 0:
        return BlockReason.GDN_SLOTS
    if budget.tokens is not None and budget.tokens <= 0:
        return BlockReason.TOKEN_BUDGET
    if budget.kv_pages is not None and budget.kv_pages <= 0:
        return BlockReason.KV_RESERVE
    return None
