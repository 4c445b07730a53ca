"""The mechanism's check of a policy's plan, before the batcher applies it.

Invariants every plan keeps, whatever the policy:
- docs/contract.md rule 7: no id twice in the plan;
- every running sequence decodes, in the order reported, unless preempted;
- continuations are for the worker's prefills in progress and stay inside the prompt;
  admissions are queued candidates this worker can run, each with 1..prompt tokens
  after its cached tokens (0, or the worker's resume point for it);
- the policy's own limits (`Policy.budget`): batch capacity, GDN slots, token budget,
  KV pages, the decision's size, the LoRA limit. A plan may overdraw the pages only
  when it runs a lone prefill and nothing else (the empty-batch rule: the worker
  preempts or fails it).
A broken invariant is a bug in the policy: PlanError, and nothing is applied.
"""

from __future__ import annotations

from collections.abc import Callable

from service.core.decide.plan import DecisionView, Plan, PlanError
from service.core.decide.step_budget import StepBudget, decode_pages, held_pages
from service.core.vocabulary import SequenceView


def check_plan(
    view: DecisionView,
    plan: Plan,
    budget: StepBudget,
    candidate: Callable[[int], SequenceView | None],
    policy_name: str,
) -> None:
    """Raise PlanError if `plan` breaks an invariant; `budget` is a fresh one from the
    policy; `candidate(seq_id)` is the queued sequence if the worker may be given it.

    What the mechanism computed itself is not recomputed: the decodes are compared with
    the view's running ids in one comparison and charged as the view's page sum, less
    the preempted sequences' share; only what the policy chose (preemptions, chunks,
    admissions) is looked at one by one."""
    waiting = {seq.seq_id: seq for seq in view.waiting}
    # Decodes need no entry: they are the running ids (unique, validation.py) less the
    # preempted, and a chunk is only ever valid for a waiting or a queued id.
    seen: set[int] = set()

    def once(seq_id: int, where: str) -> None:
        if seq_id in seen:
            raise PlanError(f"policy {policy_name}: seq_id {seq_id} twice in the plan ({where})")
        seen.add(seq_id)

    expected, num_decode_pages = view.running_ids, view.decode_pages
    if plan.preempt:
        running = {seq.seq_id: seq for seq in view.running}
        for seq_id in plan.preempt:
            once(seq_id, "preempt")
            seq = running.get(seq_id)
            if seq is None and seq_id not in waiting:
                raise PlanError(
                    f"policy {policy_name}: preempts seq_id {seq_id}, which the "
                    "worker does not hold"
                )
            if seq is None:
                budget.give_back(held_pages(waiting[seq_id], budget.page_size, running=False))
            else:
                budget.give_back(held_pages(seq, budget.page_size, running=True))
                num_decode_pages -= decode_pages(seq, budget.page_size)
        expected = tuple(seq_id for seq_id in expected if seq_id not in seen)
    if plan.decode != expected:
        raise PlanError(
            f"policy {policy_name}: decode must list every running sequence not "
            "preempted, in the order reported"
        )
    budget.take_decodes(len(plan.decode), num_decode_pages)
    for chunk in plan.continuations:
        once(chunk.seq_id, "continuations")
        seq = waiting.get(chunk.seq_id)
        if seq is None or not 0 <= chunk.chunk_len <= seq.spec_prompt_len() - seq.cursor:
            raise PlanError(
                f"policy {policy_name}: continuation {chunk} is not the next "
                "part of a prefill the worker holds"
            )
        budget.take_chunk(seq.cursor, chunk.chunk_len)
    for chunk in plan.admissions:
        once(chunk.seq_id, "admissions")
        seq = candidate(chunk.seq_id)
        if seq is None or not 1 <= chunk.chunk_len <= seq.num_tokens() - chunk.cached_tokens:
            raise PlanError(
                f"policy {policy_name}: admission {chunk} is not a queued "
                "sequence this worker can run, or its length is out of range"
            )
        if chunk.cached_tokens not in (0, view.cached_tokens(seq)):
            raise PlanError(
                f"policy {policy_name}: admission {chunk} takes cached tokens "
                "that are not the worker's resume point for it"
            )
        budget.take_admission(seq, chunk.chunk_len, chunk.cached_tokens)
    lone_prefill = (
        not plan.decode
        and not plan.admissions
        and len(plan.continuations) == 1
        and view.num_active == 1
    )
    problem = budget.overdrawn(pages_may_overdraw=lone_prefill)
    if problem is not None:
        raise PlanError(f"policy {policy_name}: the plan takes {problem}")
