"""What a policy sees of one SelectBatch, and what it answers: a plan.

A policy gets a read-only `DecisionView` and returns a `Plan`; the mechanism
(service/core/plan_check.py, service/core/batcher.py) checks the plan against the invariants and applies it.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from service.core.tenants import TentativeService

if TYPE_CHECKING:
    from service.core.queue import AdmissionQueue
    from service.core.step_budget import StepBudget


class BlockReason(enum.Enum):
    """What limited admissions to a worker in one decision (a bounded metric label)."""

    BATCH_FULL = "batch_full"
    KV_RESERVE = "kv_reserve"  # fifo's reserve guard; the budget policies' page check
    GDN_SLOTS = "gdn_slots"
    DRAINING = "draining"
    TOKEN_BUDGET = "token_budget"
    MESSAGE_SIZE = "message_size"


class PreemptReason(enum.Enum):
    """Why a running sequence was preempted (a bounded metric label)."""

    KV_GROWTH = "kv_growth"  # the scheduler: this iteration's decodes need more pages
    NO_PROGRESS = "no_progress"  # the scheduler: prefills stuck on pages, nothing else ran
    WORKER = "worker"  # the worker evicted it on its own and reported it


class SequenceView(Protocol):
    """What a policy may read of a sequence (service.core.sequences.Sequence)."""

    @property
    def seq_id(self) -> int: ...

    @property
    def priority(self) -> int: ...

    @property
    def tenant(self) -> str: ...

    @property
    def adapter_id(self) -> str: ...

    @property
    def cursor(self) -> int:
        """Prompt tokens of the current spec handed out so far."""

    @property
    def admission_order(self) -> int:
        """Larger: admitted later."""

    def resume_len(self) -> int:
        """Prompt length of the spec its next admission would carry."""

    def spec_prompt_len(self) -> int:
        """Prompt length of its current assignment's spec."""

    def num_tokens(self) -> int:
        """Tokens of its current assignment so far (spec prompt + reported tokens)."""

    def spec_wire_bytes(self) -> int:
        """Upper bound of the bytes its first chunk takes in a decision."""


@dataclass(frozen=True)
class DecisionView:
    """One worker's SelectBatch, after its report was applied (contract rule 1)."""

    worker_id: str
    max_batch_size: int
    chunk_size: int
    page_size: int
    total_kv_pages: int
    # Sequences assigned to the worker, in the order its report lists them.
    running: tuple[SequenceView, ...]
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
    # Queued sequences this worker can run, in the policy's order, lazily.
    queue: Callable[[], Iterator[SequenceView]]
    # The fair policy's tenant counters, with this plan's own charges on top.
    service: TentativeService


@dataclass(frozen=True)
class Chunk:
    """A prefill chunk of `length` tokens of one sequence (where it starts is the
    mechanism's business: 0 for an admission, the sequence's cursor otherwise)."""

    seq_id: int
    length: int


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
    """The single decision point of a SelectBatch."""

    name: str
    # Tokens per iteration (decodes + prefill chunks); None: no token budget.
    token_budget: int | None
    # Whether its queue order reads the tenants' service counters (they are kept then).
    uses_tenant_service: bool

    def new_queue(self) -> AdmissionQueue:
        """An empty queue in this policy's order."""

    def budget(self, view: DecisionView) -> StepBudget:
        """The limits of this iteration: what the plan may spend (and is checked against)."""

    def plan(self, view: DecisionView) -> Plan:
        """Which sequences decode, which get prefill chunks of what length, which are
        admitted and which preempted."""
