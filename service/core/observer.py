"""Hooks through which the core reports what it does (metrics and logs listen here).

The core calls these synchronously, inside the call that made the change (one event
loop serializes every call, so a slow hook delays every worker): keep them cheap.
"""

from __future__ import annotations

import enum

from service.core.types import Decision, FinishReason, WorkerReport
from service.core.vocabulary import (
    BlockReason,
    HandoffEnd,
    PlacementPass,
    PreemptReason,
    StepTimeRefusal,
)


class RequeueReason(enum.Enum):
    """Why a sequence went back to the head of the queue (a bounded metric label)."""

    PREEMPTED = "preempted"
    LOST = "lost"
    REREGISTERED = "reregistered"
    LEASE_EXPIRED = "lease_expired"
    DEREGISTERED = "deregistered"
    CACHE_MISS = "cache_miss"  # its first chunk's resume point was gone: admitted again


class EvictReason(enum.Enum):
    """Why an id was put in a decision's evict list (a bounded metric label)."""

    CANCELLED = "cancelled"
    NOT_ASSIGNED = "not_assigned"


class SchedulerObserver:
    """No-op base: override what you need."""

    def on_submitted(self, seq_id: int, tenant: str, prompt_len: int) -> None: ...

    def on_tokens(self, seq_id: int, num_tokens: int) -> None: ...

    def on_tokens_reported(self, worker_id: str, seq_ids: list[int], num_tokens: list[int]) -> None:
        """The new tokens of one report, in one call: seq_ids[i] got num_tokens[i] (an id
        may appear twice). This default calls on_tokens for each, in order; an observer
        with per-report work to share (one clock reading, one counter update) overrides
        this one instead."""
        if type(self).on_tokens is SchedulerObserver.on_tokens:
            return  # the no-op: nothing to call per sequence
        on_tokens = self.on_tokens
        for seq_id, num in zip(seq_ids, num_tokens):
            on_tokens(seq_id, num)

    def on_admitted(self, seq_id: int, worker_id: str, queue_wait_seconds: float) -> None: ...

    def on_requeued(self, seq_id: int, worker_id: str, reason: RequeueReason) -> None: ...

    def on_finished(self, seq_id: int, reason: FinishReason) -> None: ...

    def on_disowned(self, seq_ids: frozenset[int]) -> None:
        """A replica's core forgot these, unfinished: another replica took them, or they
        went back to the shared queue."""

    def on_evicted(self, seq_id: int, worker_id: str, reason: EvictReason) -> None: ...

    def on_admission_blocked(self, worker_id: str, reason: BlockReason) -> None: ...

    def on_placement_passed(self, worker_id: str, reason: PlacementPass) -> None:
        """`worker_id` admitted a sequence whose longest cached prefix another worker
        holds, by the placement rule `reason` (policies/placement.py)."""

    def on_decision(self, report: WorkerReport, decision: Decision) -> None: ...

    def on_worker_registered(
        self, worker_id: str, total_kv_pages: int, total_gdn_slots: int
    ) -> None: ...

    def on_worker_removed(self, worker_id: str) -> None: ...

    def on_queue_depth(self, depth: int) -> None: ...

    def on_queue_bands(self, depth_by_band: dict[str, int]) -> None:
        """Queued sequences per priority band (service.core.tables.queue.PRIORITY_BANDS)."""

    def on_preempted(self, seq_id: int, worker_id: str, reason: PreemptReason) -> None: ...

    def on_plan(self, worker_id: str, num_batched_tokens: int, token_budget: int | None) -> None:
        """A decision's tokens (decodes + prefill chunks) and the budget it had (None:
        the policy has no token budget)."""

    def on_step_time(
        self, worker_id: str, predicted_seconds: float, measured_seconds: float
    ) -> None:
        """A worker's measured step and what its model predicted for it beforehand."""

    def on_step_time_refused(
        self,
        worker_id: str,
        reason: StepTimeRefusal,
        claimed_seconds: float,
        bound_seconds: float,
        first: bool,
    ) -> None:
        """A worker's reported step time contradicted what the scheduler saw (`bound`:
        the elapsed time or the cadence it broke) and was not learned; `first`: the
        first such claim of this worker."""

    def on_change_refused(self, num_sequences: int, reason: str) -> None:
        """The store refused a change for its data: `num_sequences` sequences were
        failed for it (0: the change was dropped whole)."""

    def on_prefill_tokens(self, worker_id: str, computed: int, cached: int) -> None:
        """Prompt tokens of one decision's chunks: to compute, and taken from the
        worker's prefix cache (first chunks' cached_tokens)."""

    def on_cache_miss(self, seq_id: int, worker_id: str) -> None:
        """A first chunk's resume point was gone on the worker (it will be admitted again)."""

    def on_resume_points(self, worker_id: str, num_points: int, num_removed: int) -> None:
        """The resume points the core now knows for the worker (after each report), and
        how many of those it knew the report removed (evicted on the worker)."""

    def on_handoff(
        self,
        seq_id: int,
        sender: str,
        receiver: str,
        end: HandoffEnd,
        num_bytes: int,
        transfer_seconds: float,
    ) -> None:
        """A handoff ended (docs/disaggregation.md): done, or failed and its sequence
        resumed on the sender or requeued; bytes and seconds as the receiver reported."""

    def on_handoff_started(self, seq_id: int, sender: str, receiver: str) -> None:
        """A handoff was booked: a SEND in `sender`'s decision, a RECEIVE for `receiver`'s
        next one (a receiver parked on a long poll should ask again)."""

    def on_receive_ready(self, seq_id: int, receiver: str) -> None:
        """A booked RECEIVE waited for a token the sender's step had in flight; the
        sender reported it, so `receiver`'s next decision carries it (a receiver parked
        on a long poll should ask again)."""

    def on_served(self, tenant: str, num_tokens: int) -> None:
        """Tokens served to a tenant: prompt tokens handed out, generated tokens reported."""
