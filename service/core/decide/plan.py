"""What a policy sees of one SelectBatch, and what it answers: a plan.

A policy gets a read-only `DecisionView` and returns a `Plan`; the mechanism
(service/core/decide/plan_check.py, service/core/decide/batcher.py) checks the plan against
the invariants and applies it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from service.core.decide.step_budget import StepBudget
from service.core.learn.step_model import StepTimeModel
from service.core.tables.tenants import TentativeService
from service.core.vocabulary import BlockReason, PlacementPass, PreemptReason, SequenceView

if TYPE_CHECKING:
    from service.core.decide.fleet import FleetView


@dataclass(frozen=True)
class DecisionView:
    """One worker's SelectBatch, after its report was applied (docs/contract.md
    rule 1)."""

    worker_id: str
    max_batch_size: int
    chunk_size: int
    page_size: int
    total_kv_pages: int
    # Sequences assigned to the worker, in the order its report lists them.
    running: tuple[SequenceView, ...]
    # The seq_ids of `running`, in the same order.
    running_ids: tuple[int, ...]
    # New KV pages the decodes of every running sequence need this iteration, together
    # (step_budget.decode_pages summed over `running`).
    decode_pages: int
    waiting: tuple[SequenceView, ...]
    # len(report.waiting) + len(report.running): capacity counts every id reported.
    num_active: int
    kv_free_pages: int
    gdn_free_slots: int
    draining: bool  # the worker's own, or an operator's
    # Non-empty adapter_ids among the worker's assigned sequences.
    adapters_in_use: frozenset[str]
    # Bytes left for admissions in the decision (--max-message-bytes less the rest).
    decision_bytes: int
    # Queued sequences this worker can run, in the queue order, lazily.
    queue: Callable[[], Iterator[SequenceView]]
    # The fair policy's tenant counters, with this plan's own charges on top.
    service: TentativeService
    # The worker's learned step time (None: not learned, no latency target is set).
    step_model: StepTimeModel | None = None
    # With a step model: the tokens of the running sequences, summed (their decode context).
    running_context: int = 0
    # The block chunks that can end on a multiple of it should (docs/contract.md, "Prefix
    # caching"): the worker's cache block when it keeps GDN snapshots (a hybrid model
    # snapshots only where a forward ends on a block); 0 without a cache, with
    # --prefix-caching off, or for a worker that keeps no snapshots (an attention-only
    # model caches every full block whatever the chunks: aligning would only add a step).
    align_block_tokens: int = 0
    # Prompt tokens a queued sequence may take from this worker's cache: its longest
    # resume point here strictly below its prompt's length (0: none).
    cached_tokens: Callable[[SequenceView], int] = lambda seq: 0
    # Where queued prefixes are cached across the fleet, and its load, for the placement
    # policy (policies/placement.py). None (a worker without a cache, or --prefix-caching
    # off): admissions follow the queue order exactly.
    fleet: FleetView | None = None
    # The most tokens the worker's engine runs in one step (0: no limit of its own).
    max_step_tokens: int = 0


@dataclass(frozen=True)
class Chunk:
    """A prefill chunk of `chunk_len` tokens of one sequence (where it starts is the
    mechanism's business: 0 for an admission, the sequence's cursor otherwise)."""

    seq_id: int
    chunk_len: int
    # Admissions only: prompt tokens taken from the worker's cache before the chunk
    # (DecisionView.cached_tokens of the sequence, or 0); the chunk starts there.
    cached_tokens: int = 0
    # Admissions only: the placement rule that let this worker take it though another
    # worker holds a longer prefix of it (None: none does, or no placement).
    passed: PlacementPass | None = None


@dataclass(frozen=True)
class Plan:
    """A policy's answer for one worker iteration."""

    decode: tuple[int, ...] = ()
    continuations: tuple[Chunk, ...] = ()
    admissions: tuple[Chunk, ...] = ()
    # Running sequences taken back, and why (the same reason for all in one plan).
    preempt: tuple[int, ...] = ()
    preempt_reason: PreemptReason = PreemptReason.KV_GROWTH
    # What stopped admissions while the queue still had candidates; None if nothing did.
    blocked: BlockReason | None = None


class PlanError(Exception):
    """A policy broke an invariant: a bug in the policy, never the caller's fault."""


class Policy(Protocol):
    """The single decision point of a SelectBatch: how a batch is filled. Which queued
    sequence comes first is the queue order's (service/core/decide/orders.py)."""

    name: str
    # The most tokens per iteration (decodes + prefill chunks); None: no token budget.
    # Each running sequence decodes one token of it every iteration, so a worker's batch
    # is capped at it. A decision's own may be less (`budget(view).tokens`).
    token_budget: int | None

    def budget(self, view: DecisionView) -> StepBudget:
        """The limits of this iteration: what the plan may spend (and is checked against)."""

    def plan(self, view: DecisionView) -> Plan:
        """Which sequences decode, which get prefill chunks of what length, which are
        admitted and which preempted."""
