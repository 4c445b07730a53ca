"""The worker registry: joining with settings from the config, leaving, and leases.

Over the worker ledger (ledger.py, mechanism only): this is where a worker's settings
are chosen and where a silent worker's lease runs out, its sequences back to the queue.
"""

from __future__ import annotations

from service.core.cache.prefix_cache import ResumePoints
from service.core.config import SchedulerConfig
from service.core.decide.disaggregation import Disaggregation
from service.core.observer import RequeueReason
from service.core.persist.store import StoredWorker
from service.core.tables.ledger import WorkerRecord
from service.core.tables.lifecycle import Lifecycle
from service.core.tables.tables import Tables
from service.core.types import WorkerRegistration, WorkerSettings


class WorkerRegistry:
    """Adds and removes workers, marking each change for the next save."""

    def __init__(
        self,
        tables: Tables,
        lifecycle: Lifecycle,
        config: SchedulerConfig,
        token_budget: int | None,
        stall_seconds: float | None,
        handoffs: Disaggregation,
    ) -> None:
        """`token_budget`: the policy's (None: none); a worker's batch is capped at it.
        `handoffs`: told of every worker that leaves or registers again, and of the sweep."""
        self._config = config
        self._token_budget = token_budget
        self._ledger = tables.ledger
        self._lifecycle = lifecycle
        self._changes = tables.changes
        self._observer = tables.observer
        self._clock = tables.clock
        self._stall_seconds = stall_seconds
        self._handoffs = handoffs
        self._last_lease_check: float | None = None
        # The latest incarnation handed out (saved with every change of the workers).
        self.last_incarnation = 0

    def next_incarnation(self) -> int:
        """An incarnation higher than any handed out before."""
        self.last_incarnation += 1
        return self.last_incarnation

    def add(self, registration: WorkerRegistration, incarnation: int) -> WorkerRecord:
        # A new incarnation holds nothing of the old one's handoffs (failure rules 1, 2).
        self._handoffs.worker_gone(registration.worker_id)
        config = self._config
        max_batch_size = min(
            registration.max_batch_size or config.max_batch_size, config.max_worker_batch_size
        )
        if self._token_budget is not None:
            # Each running sequence decodes one token of the budget every iteration.
            max_batch_size = min(max_batch_size, self._token_budget)
        settings = WorkerSettings(
            chunk_size=config.chunk_size,
            max_batch_size=max_batch_size,
            prefill_reserve_pages=config.prefill_reserve_pages,
            lease_ttl_ms=config.lease_ttl_ms,
            incarnation=incarnation,
        )
        # A new incarnation knows no resume points until its first report (a reset).
        block_tokens = registration.cache_block_tokens if config.prefix_caching == "on" else 0
        record = WorkerRecord(
            registration,
            settings,
            last_call_at=self._clock(),
            resume_points=ResumePoints(
                block_tokens, fleet=self._ledger.fleet_cache, worker_id=registration.worker_id
            ),
        )
        self._ledger.add(record)
        self._observer.on_worker_registered(
            registration.worker_id, registration.total_kv_pages, registration.total_gdn_slots
        )
        return record

    def mark_changed(self, worker: WorkerRecord) -> None:
        """Mark the stored part of `worker` (registration, incarnation, operator drain) for
        the next save: after a registration, and after a drain is set or lifted."""
        self._changes.worker_changed(
            StoredWorker(worker.registration, worker.drain_requested, worker.incarnation)
        )

    def remove(self, worker: WorkerRecord, reason: RequeueReason) -> list[int]:
        """Take `worker` out; returns the ids that went back to the queue."""
        self._ledger.remove(worker.worker_id)
        requeued = self._lifecycle.requeue(worker, list(worker.assigned), reason)
        self._changes.worker_left(worker.worker_id)
        self._handoffs.worker_gone(worker.worker_id)
        self._observer.on_worker_removed(worker.worker_id)
        return requeued

    def expire(self) -> list[str]:
        """Drop workers silent for longer than their lease; returns their ids."""
        now = self._clock()
        self._forgive_own_stall(now)
        expired = self._ledger.expired(now)
        for worker in expired:
            self.remove(worker, RequeueReason.LEASE_EXPIRED)
        self._handoffs.expire()
        return [worker.worker_id for worker in expired]

    def _forgive_own_stall(self, now: float) -> None:
        """Workers cannot be heard while the scheduler does not run: move their last call
        on by the time it stood still, so the stall does not expire their leases."""
        last, self._last_lease_check = self._last_lease_check, now
        if self._stall_seconds is None or last is None or now - last <= self._stall_seconds:
            return
        stalled = now - last
        for worker in self._ledger:
            worker.last_call_at = min(now, worker.last_call_at + stalled)
            gaps = worker.call_gaps  # nor its gap between calls (placement's wait bound)
            if gaps.last_call_at is not None:
                gaps.last_call_at = min(now, gaps.last_call_at + stalled)
