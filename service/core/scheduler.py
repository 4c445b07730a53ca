"""The scheduling core: queue, sequence table, worker ledger and policy behind one API.

Single-threaded by design: the caller serializes calls (one event loop). No gRPC, no
Prometheus: adapters convert messages and listen through an observer.

A SelectBatch reads in one direction: the worker's report is applied (report/reconcile.py,
docs/contract.md rule 1), a read-only view goes to the policy, the policy returns a plan, the
mechanism checks the plan and applies it (decide/batcher.py), and the change is saved
(persist/changes.py) before the call returns: every state-changing call runs in one save
scope (`_saving`, persist/saving.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from service.core.config import SchedulerConfig
from service.core.decide.batcher import Batcher, decides_later
from service.core.decide.disaggregation import Disaggregation
from service.core.decide.orders import queue_order
from service.core.decide.policies import make_policy
from service.core.decide.shedding import Shedder
from service.core.errors import InvalidArgument, NotFound, QueueFull
from service.core.learn.step_model import StepTimeModel
from service.core.learn.step_times import StepTimes
from service.core.observer import RequeueReason, SchedulerObserver
from service.core.persist.changes import ChangeSet
from service.core.persist.recovery import Recovery
from service.core.persist.saving import Saver
from service.core.persist.store import StateStore, StoredState
from service.core.report.reconcile import Reconciler
from service.core.report.validation import check_incarnation, check_submit, validate_report
from service.core.report.workers import WorkerRegistry
from service.core.tables.ledger import WorkerLedger
from service.core.tables.lifecycle import Lifecycle
from service.core.tables.reads import OutputView, Reads
from service.core.tables.sequences import Sequence, SequenceTable
from service.core.tables.steady import SteadyStep
from service.core.tables.tables import Tables
from service.core.tables.tenants import TenantLedger
from service.core.types import (
    SEES_ALL,
    Caller,
    Decision,
    FinishReason,
    SchedulerStatus,
    SequenceInfo,
    SequenceState,
    SubmitParams,
    SubmitResult,
    WorkerRegistration,
    WorkerReport,
    WorkerSettings,
)

__all__ = ["DEFAULT_MAX_DECISION_BYTES", "OutputView", "Scheduler"]

# gRPC's default message limit; the server passes its --max-message-bytes.
DEFAULT_MAX_DECISION_BYTES = 4 * 1024 * 1024


class Scheduler:
    """Holds the admission queue and answers each worker's SelectBatch.

    Guarantees, whatever the call order: a sequence is queued, on exactly one worker,
    or finished; a sequence that leaves a worker unfinished goes back to the queue
    (the head, or its place in the fair order); no id is ever reused.

    With a `store`, every call that changes state saves the change before it returns,
    and a new Scheduler over the same store carries on where the old one stopped. After
    a failed save, every later state-changing call first saves what is still unsaved (and
    fails the same way while the store does), so no answer rests on unsaved state.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        observer: SchedulerObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        max_finished_retained: int = 100_000,
        store: StateStore | None = None,
        stall_seconds: float | None = None,
        max_decision_bytes: int = DEFAULT_MAX_DECISION_BYTES,
        step_prior: StepTimeModel | None = None,
    ) -> None:
        """`stall_seconds`: when lease checks (every call, and a caller's sweeper) are this
        far apart, the scheduler itself stood still (frozen, paused, starved): that time
        is not counted against the workers' leases. None: every gap counts (tests that
        move a fake clock by hand). `wall_clock` dates submissions for the store, so
        that time waited before a restart still counts towards aging. `step_prior`: the
        step-time model each worker's learning starts from (fitted to a step table);
        None: the cautious default."""
        self.config = config.validate()
        self._policy = make_policy(config)
        order = queue_order(config)
        tables = Tables(
            sequences=SequenceTable(max_finished_retained),
            queue=order.new_queue(),
            ledger=WorkerLedger(),
            tenants=(
                TenantLedger(dict(config.tenant_weights)) if order.uses_tenant_service else None
            ),
            changes=ChangeSet(store),
            observer=observer or SchedulerObserver(),
            clock=clock,
        )
        self._tables = tables
        # The tables this class reads often, by name.
        self._sequences, self._queue, self._ledger = tables.sequences, tables.queue, tables.ledger
        self._tenants, self._changes = tables.tenants, tables.changes
        self._observer, self._clock, self._wall_clock = tables.observer, clock, wall_clock
        self._max_decision_bytes = max_decision_bytes
        self._lifecycle = lifecycle = Lifecycle(tables)
        steady = SteadyStep(tables, lifecycle)
        handoffs = Disaggregation(
            tables,
            steady,
            config.lease_ttl_ms / 1000,
            wall_clock(),
            min_uncached_tokens=config.handoff_min_tokens,
            priced=config.handoff_rule == "priced",
        )
        self._reconciler = Reconciler(tables, lifecycle, steady, handoffs)
        self._recovery = Recovery(tables, lifecycle, wall_clock)
        self._batcher = Batcher(
            tables,
            lifecycle,
            steady,
            self._policy,
            config.policy,
            max_decision_bytes,
            config.max_loras,
            handoffs,
        )
        self._workers = WorkerRegistry(
            tables, lifecycle, config, self._policy.token_budget, stall_seconds, handoffs
        )
        # `with self._saving() as saved:` is the save scope of each state-changing call.
        self._saving = Saver(tables, lifecycle, lambda: self._workers.last_incarnation).scope
        # Each worker's step times, learned while a latency target is set.
        self._step_times = (
            StepTimes(step_prior.copy if step_prior else StepTimeModel, clock)
            if config.learns_step_times
            else None
        )
        self._shedder = Shedder(config, tables, self._policy, self._step_times)
        # The tenant's service so far, as the queue order reads it (0 without counters).
        self._served = self._tenants.served if self._tenants is not None else _no_service
        self._reads = Reads(tables, self._served)
        if store is not None:
            self._recover(store.load())

    # ----------------------------------------------------------------- clients

    def submit(self, params: SubmitParams) -> SubmitResult:
        """Enqueue a sequence at the tail; a request_id its principal used before returns
        that first seq_id (another principal's use of the same request_id is no match)."""
        known = self._sequences.by_request_id(params.principal, params.request_id)
        if known is not None:
            return SubmitResult(known.seq_id, self._reads.position(known))
        self.check_submit(params)
        if len(self._queue) >= self.config.max_queue:
            raise QueueFull(
                f"the admission queue holds max_queue={self.config.max_queue} sequences; "
                "retry later"
            )
        per_tenant = self.config.max_queue_per_tenant
        if per_tenant and self._queue.count(params.tenant) >= per_tenant:
            raise QueueFull(
                f"tenant {params.tenant!r} already has {per_tenant} sequences queued "
                f"(max_queue_per_tenant={per_tenant}); retry later"
            )
        self._shed_if_late(params)
        # Acknowledged to the client: the save must survive a power loss.
        with self._saving(sync=True) as saved:
            seq = self._sequences.create(params, self._clock(), self._wall_clock())
            if self._tenants is not None and self._tenants.activate(seq.tenant):
                self._changes.tenant_served(seq.tenant, self._tenants.served(seq.tenant))
            self._queue.push_back(seq)
            self._changes.created(seq)
            saved.undo.append(lambda: self._uncreate(seq))
        self._observer.on_submitted(seq.seq_id, seq.tenant, seq.prompt_len)
        self._lifecycle.queue_changed()
        return SubmitResult(seq.seq_id, self._reads.position(seq))

    def check_submit(self, params: SubmitParams) -> None:
        """InvalidArgument if `params` could never run under this config (a replica checks
        before it writes a submission to the shared queue)."""
        check_submit(params, self.config, self._max_decision_bytes)

    def cancel(self, seq_id: int, caller: Caller = SEES_ALL) -> bool:
        """Cancel a queued or assigned sequence; False if it had already finished.

        A cancelled sequence on a worker shows up in that worker's next `evict`. Another
        principal's sequence is NotFound to `caller`, exactly as an unknown id.
        """
        with self._saving(sync=True):
            seq = self._require(seq_id, caller)
            if seq.is_finished:
                return False
            if seq.state is SequenceState.QUEUED:
                self._queue.remove(seq_id)
                self._lifecycle.queue_changed()
            else:
                worker = self._ledger.find(seq.worker_id or "")
                if worker is not None:
                    worker.assigned.pop(seq_id, None)
            self._lifecycle.finish(seq, FinishReason.CANCELLED)
            return True

    def get_sequence(self, seq_id: int, caller: Caller = SEES_ALL) -> SequenceInfo:
        """A view of `seq_id`; NotFound if unknown, or another principal's to `caller`."""
        return self._reads.sequence_info(self._require(seq_id, caller))

    def read_output(self, seq_id: int, start: int, caller: Caller = SEES_ALL) -> OutputView:
        """Generated tokens from index `start` on (for streaming); NotFound as get_sequence."""
        return self._reads.output(self._require(seq_id, caller), start)

    def num_unservable_queued(self) -> int:
        """Queued sequences whose adapter no live worker has (`Reads.servable_adapters`)."""
        return self._reads.num_unservable(self._reads.servable_adapters())

    def status(self) -> SchedulerStatus:
        return self._reads.status(self.config.policy)

    # ----------------------------------------------------------------- workers

    def worker_ids(self) -> frozenset[str]:
        """The ids of the workers registered now."""
        return frozenset(worker.worker_id for worker in self._ledger)

    def register_worker(self, registration: WorkerRegistration) -> WorkerSettings:
        """Join, or start a new incarnation: what the old one held goes back to the queue.

        The answer's `incarnation` is higher than any handed out before; calls naming an
        older one of this worker_id are refused from now on (Superseded).
        """
        if not registration.worker_id:
            raise InvalidArgument("worker_id must not be empty")
        if registration.page_size == 0:
            raise InvalidArgument("page_size must be at least 1 (tokens per KV page), got 0")
        with self._saving():
            old = self._ledger.remove(registration.worker_id)
            if old is not None:
                self._lifecycle.requeue(old, list(old.assigned), RequeueReason.REREGISTERED)
            record = self._workers.add(registration, self._workers.next_incarnation())
            self._workers.mark_changed(record)
        if self._step_times is not None:
            self._step_times.registered(registration.worker_id)
        return record.settings

    def deregister_worker(self, worker_id: str, incarnation: int = 0) -> int:
        """Leave cleanly; returns how many sequences went back to the head of the queue.

        `incarnation` 0 means the latest; an older one is refused (Superseded).
        """
        with self._saving():
            worker = self._ledger.get(worker_id)
            check_incarnation(worker, incarnation)
            return len(self._workers.remove(worker, RequeueReason.DEREGISTERED))

    def drain_worker(self, worker_id: str, resume: bool) -> int:
        """Operator drain: admit nothing new to the worker, or (resume) lift that drain.

        What the worker holds keeps prefilling, decoding and finishing either way; the
        drain lasts until lifted or until the worker registers again. Returns how many
        sequences are still assigned to it; UnknownWorker if it is not registered.
        """
        with self._saving():
            worker = self._ledger.get(worker_id)
            worker.drain_requested = not resume
            self._workers.mark_changed(worker)
            return len(worker.assigned)

    def expire_leases(self) -> list[str]:
        """Drop workers silent for longer than their lease; returns their ids."""
        with self._saving():
            return self._workers.expire()

    def select_batch(self, report: WorkerReport) -> Decision:
        """Apply one worker's report, then decide its batch (the policy plans, the
        mechanism checks and applies; docs/contract.md rules 1-7 and "Policies")."""
        with self._saving() as saved:  # saved even when the report is refused below
            self._workers.expire()
            worker = self._ledger.get(report.worker_id)
            check_incarnation(worker, report.incarnation)
            reported = validate_report(report, worker)
            evict = self._reconciler.apply(worker, report, reported)
            step_model = self._learn_step_time(report)
            if decides_later(worker, report, evict):
                # Runs and evicts nothing: what a commit disowns now is the next report's stray.
                return Decision(iteration=worker.iteration)
            decision = self._batcher.decide(worker, report, reported, evict, step_model)
        if saved.disowned:
            decision = _without(decision, saved.disowned, reported)
        if self._step_times is not None:
            busy = decision.prefill or decision.decode
            self._step_times.decided(
                report.worker_id, self._batcher.shape(decision) if busy else None
            )
        self._observer.on_decision(report, decision)
        return decision

    # ----------------------------------------------------------------- internals

    def is_sheddable(self, params: SubmitParams) -> bool:
        """Whether `params` may be shed: a negative priority under a TTFT target."""
        return self._shedder.is_sheddable(params)

    def _shed_if_late(self, params: SubmitParams, tokens_elsewhere: int = 0) -> None:
        """DeadlineUnreachable for a sheddable request that cannot start in time
        (service/core/decide/shedding.py)."""
        self._shedder.check(params, tokens_elsewhere)

    def _learn_step_time(self, report: WorkerReport):
        """Learn from the step time `report` carries; the worker's model (None: none
        is learned)."""
        if self._step_times is None:
            return None
        worker_id = report.worker_id
        step = self._step_times.measured(worker_id, report.last_step_us)
        if step is not None and step.refusal is not None:
            self._observer.on_step_time_refused(
                worker_id, step.refusal, step.seconds, step.bound_seconds, step.first_refusal
            )
        elif step is not None:
            self._observer.on_step_time(worker_id, step.predicted_seconds, step.seconds)
        return self._step_times.model(worker_id)

    def _recover(self, state: StoredState) -> None:
        """Rebuild from the store: the queue in its order, workers with what they held.

        A recovered worker is registered as it was, with a fresh lease: its next
        SelectBatch reconciles (what it still holds stays, what it does not mention goes
        back to the head of the queue), and if it never calls its lease runs out.
        """
        with self._saving():
            self._workers.last_incarnation = max(
                [state.last_incarnation, *(w.incarnation for w in state.workers)]
            )
            for stored in state.workers:
                record = self._workers.add(stored.registration, stored.incarnation)
                record.drain_requested = stored.drain_requested
            self._recovery.restore(state)

    def _uncreate(self, seq: Sequence) -> None:
        """Undo a submission the store refused (its id stays used)."""
        self._queue.remove(seq.seq_id)
        if self._tenants is not None:
            self._tenants.deactivate(seq.tenant)
        self._sequences.discard_new(seq)
        self._changes.uncreated(seq)

    def _require(self, seq_id: int, caller: Caller = SEES_ALL) -> Sequence:
        seq = self._sequences.get(seq_id)
        if seq is None or not caller.may_see(seq.params.principal):
            raise NotFound.seq_id(seq_id)
        return seq


def _no_service(tenant: str) -> float:
    return 0.0


def _without(decision: Decision, disowned: frozenset[int], reported: frozenset[int]) -> Decision:
    """`decision` less the sequences given up while it was saved (another replica owns
    them): not run here, and evicted if the worker holds them."""
    return replace(
        decision,
        prefill=tuple(c for c in decision.prefill if c.seq_id not in disowned),
        decode=tuple(s for s in decision.decode if s not in disowned),
        preempt=tuple(s for s in decision.preempt if s not in disowned),
        handoffs=tuple(h for h in decision.handoffs if h.seq_id not in disowned),
        evict=tuple(dict.fromkeys([*decision.evict, *(disowned & reported)])),
    )
