"""The scheduling core: queue, sequence table, worker ledger and policy behind one API.

Single-threaded by design: the caller serializes calls. No gRPC, no Prometheus:
adapters convert messages and listen through an observer.

A SelectBatch reads in one direction: the worker's report is applied (contract rule 1),
a read-only view goes to the policy, the policy returns a plan, the mechanism checks
the plan (batcher.py) and applies it here, and the change is saved (changes.py).
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from service.core.batcher import DECISION_FIXED_BYTES, Batcher
from service.core.changes import ChangeSet
from service.core.config import SchedulerConfig
from service.core.errors import InvalidArgument, NotFound, QueueFull
from service.core.ledger import WorkerLedger, WorkerRecord
from service.core.observer import EvictReason, RequeueReason, SchedulerObserver
from service.core.plan import PreemptReason
from service.core.policies import make_policy
from service.core.sequences import Sequence, SequenceTable, spec_wire_bytes
from service.core.store import (
    Disowned, StateStore, StoredSequence, StoredState, StoredWorker, StoreError,
)
from service.core.tenants import TenantLedger
from service.core.validation import check_incarnation, validate_report
from service.core.types import (
    Decision, FinishReason, SchedulerStatus, SequenceInfo, SequenceState,
    SubmitParams, SubmitResult, WorkerRegistration, WorkerReport, WorkerSettings, WorkerStatus,
)

# gRPC's default message limit; the server passes its --max-message-bytes.
DEFAULT_MAX_DECISION_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class OutputView:
    """Tokens of a sequence from some offset on, and whether it has finished."""

    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None
    error_message: str = ""  # why it failed, for FAILED


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
    ) -> None:
        """`stall_seconds`: when lease checks (every call, and a caller's sweeper) are this
        far apart, the scheduler itself stood still (frozen, paused, starved): that time
        is not counted against the workers' leases. None: every gap counts (tests that
        move a fake clock by hand). `wall_clock` dates submissions for the store, so
        that time waited before a restart still counts towards aging."""
        self.config = config.validate()
        self._policy = make_policy(config)
        self._observer = observer or SchedulerObserver()
        self._clock = clock
        self._wall_clock = wall_clock
        self._queue = self._policy.new_queue()
        self._sequences = SequenceTable(max_finished_retained)
        self._ledger = WorkerLedger()
        self._tenants = (TenantLedger(dict(config.tenant_weights))
                         if self._policy.uses_tenant_service else None)
        self._changes = ChangeSet(store)
        self._max_decision_bytes = max_decision_bytes
        self._batcher = Batcher(self._policy, self._queue, self._sequences, self._changes,
                                self._observer, self._tenants, clock, max_decision_bytes,
                                config.max_loras)
        self._stall_seconds = stall_seconds
        self._last_lease_check: float | None = None
        # The latest incarnation handed out (saved with every change of the workers).
        self._last_incarnation = 0
        if store is not None:
            self._recover(store.load())

    # ----------------------------------------------------------------- clients

    def submit(self, params: SubmitParams) -> SubmitResult:
        """Enqueue a sequence at the tail; a known request_id returns its first seq_id."""
        known = self._sequences.by_request_id(params.request_id)
        if known is not None:
            return SubmitResult(known.seq_id, self._position(known))
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
        seq = self._sequences.create(params, self._clock(), self._wall_clock())
        if self._tenants is not None and self._tenants.activate(seq.tenant):
            self._changes.tenant_served(seq.tenant, self._tenants.served(seq.tenant))
        self._queue.push_back(seq)
        self._changes.created(seq)
        try:
            self._save(sync=True)  # acknowledged to the client: must survive a power loss
        except StoreError:
            self._queue.remove(seq.seq_id)
            if self._tenants is not None:
                self._tenants.deactivate(seq.tenant)
            self._sequences.discard_new(seq)
            self._changes.uncreated(seq)
            raise
        self._observer.on_submitted(seq.seq_id, seq.tenant, seq.prompt_len)
        self._queue_changed()
        return SubmitResult(seq.seq_id, self._position(seq))

    def cancel(self, seq_id: int) -> bool:
        """Cancel a queued or assigned sequence; False if it had already finished.

        A cancelled sequence on a worker shows up in that worker's next `evict`.
        """
        self._save(sync=True)  # what an earlier failed save left, before answering from it
        seq = self._require(seq_id)
        if seq.is_finished:
            return False
        if seq.state is SequenceState.QUEUED:
            self._queue.remove(seq_id)
            self._queue_changed()
        else:
            worker = self._ledger.find(seq.worker_id or "")
            if worker is not None:
                worker.assigned.pop(seq_id, None)
        self._finish(seq, FinishReason.CANCELLED)
        self._save(sync=True)
        return True

    def get_sequence(self, seq_id: int) -> SequenceInfo:
        seq = self._require(seq_id)
        return SequenceInfo(
            seq_id=seq.seq_id,
            state=seq.state,
            worker_id=seq.worker_id or "",
            prompt_len=seq.prompt_len,
            prefilled_tokens=seq.prefilled_tokens,
            generated_tokens=max(seq.num_generated, len(seq.output_token_ids)),
            finish_reason=seq.finish_reason,
            queue_position=self._position(seq),
            error_message=seq.error_message,
        )

    def read_output(self, seq_id: int, start: int) -> OutputView:
        """Generated tokens from index `start` on (for streaming)."""
        seq = self._require(seq_id)
        return OutputView(tuple(seq.output_token_ids[start:]), seq.is_finished, seq.finish_reason,
                          seq.error_message)

    def status(self) -> SchedulerStatus:
        now = self._clock()
        workers = tuple(
            WorkerStatus(
                worker_id=w.worker_id,
                num_assigned=len(w.assigned),
                kv_free_pages=w.kv_free_pages,
                gdn_free_slots=w.gdn_free_slots,
                total_kv_pages=w.registration.total_kv_pages,
                total_gdn_slots=w.registration.total_gdn_slots,
                iteration=w.iteration,
                draining=w.draining or w.drain_requested,
                seconds_since_last_call=max(0.0, now - w.last_call_at),
                incarnation=w.incarnation,
            )
            for w in self._ledger
        )
        return SchedulerStatus(
            queue_depth=len(self._queue),
            num_assigned=self._ledger.num_assigned(),
            policy=self._policy.name,
            workers=workers,
        )

    # ----------------------------------------------------------------- workers

    def register_worker(self, registration: WorkerRegistration) -> WorkerSettings:
        """Join, or start a new incarnation: what the old one held goes back to the queue.

        The answer's `incarnation` is higher than any handed out before; calls naming an
        older one of this worker_id are refused from now on (Superseded).
        """
        if not registration.worker_id:
            raise InvalidArgument("worker_id must not be empty")
        if registration.page_size == 0:
            raise InvalidArgument("page_size must be at least 1 (tokens per KV page), got 0")
        self._save()
        old = self._ledger.remove(registration.worker_id)
        if old is not None:
            self._requeue(old, list(old.assigned), RequeueReason.REREGISTERED)
        self._last_incarnation += 1
        record = self._add_worker(registration, self._last_incarnation)
        self._worker_joined(record)
        self._save()
        return record.settings

    def deregister_worker(self, worker_id: str, incarnation: int = 0) -> int:
        """Leave cleanly; returns how many sequences went back to the head of the queue.

        `incarnation` 0 means the latest; an older one is refused (Superseded).
        """
        self._save()
        worker = self._ledger.get(worker_id)
        check_incarnation(worker, incarnation)
        requeued = self._remove_worker(worker, RequeueReason.DEREGISTERED)
        self._save()
        return len(requeued)

    def drain_worker(self, worker_id: str, resume: bool) -> int:
        """Operator drain: admit nothing new to the worker, or (resume) lift that drain.

        What the worker holds keeps prefilling, decoding and finishing either way; the
        drain lasts until lifted or until the worker registers again. Returns how many
        sequences are still assigned to it; UnknownWorker if it is not registered.
        """
        self._save()
        worker = self._ledger.get(worker_id)
        worker.drain_requested = not resume
        self._worker_joined(worker)
        self._save()
        return len(worker.assigned)

    def expire_leases(self) -> list[str]:
        """Drop workers silent for longer than their lease; returns their ids."""
        dropped = self._expire_leases()
        self._save()
        return dropped

    def select_batch(self, report: WorkerReport) -> Decision:
        """Apply one worker's report, then decide its batch (the policy plans, the
        mechanism checks and applies; contract rules 1-7 and "Policies")."""
        self.expire_leases()  # saved before anything below can refuse the report
        worker = self._ledger.get(report.worker_id)
        check_incarnation(worker, report.incarnation)
        validate_report(report, worker.settings.max_batch_size)
        new_tokens = self._new_tokens(worker, report)  # refuses a gap before any change
        worker.last_call_at = self._clock()
        worker.iteration += 1
        worker.kv_free_pages = report.kv_free_pages
        worker.gdn_free_slots = report.gdn_free_slots
        worker.draining = report.draining

        self._apply_tokens(new_tokens)
        preempted = [*self._apply_finished(worker, report), *report.preempted]
        reported = set(report.waiting) | set(report.running)
        mentioned = reported | {f.seq_id for f in report.finished} | set(report.preempted)
        # An id may be named twice, or finished after being preempted: requeue each once.
        requeue_ids = [s for s in dict.fromkeys(preempted) if s in worker.assigned]
        lost = [s for s in worker.assigned if s not in mentioned]
        # Lost first, so the preempted ones end up at the very head, in the order given.
        self._requeue(worker, lost, RequeueReason.LOST)
        self._requeue(worker, requeue_ids, RequeueReason.PREEMPTED)
        for seq_id in requeue_ids:
            self._observer.on_preempted(seq_id, worker.worker_id, PreemptReason.WORKER)

        evict = [s for s in (*report.waiting, *report.running) if s not in worker.assigned]
        for seq_id in evict:
            self._observer.on_evicted(seq_id, worker.worker_id, self._evict_reason(seq_id))

        decision = self._batcher.decide(worker, report, reported, tuple(evict), self._requeue)
        disowned = self._save()
        if disowned:
            decision = _without(decision, disowned, reported)
        self._observer.on_decision(report, decision)
        return decision

    # ----------------------------------------------------------------- replicas

    def adopt(self, stored: Iterable[StoredSequence], worker_id: str = "") -> list[int]:
        """Take over sequences from a shared store (replicas, docs/replicas.md): queued
        ones join the local queue at their place (queue_key, arrival); with `worker_id`,
        assigned ones become that registered worker's, and its next report reconciles
        them as after a restart. Ids already known are skipped; returns those adopted."""
        worker = self._ledger.find(worker_id) if worker_id else None
        now, wall_now = self._clock(), self._wall_clock()
        queued, orphans, adopted = [], [], []
        for item in stored:
            if self._sequences.get(item.seq_id) is not None:
                continue
            seq = self._sequences.restore(item, now, wall_now)
            adopted.append(seq.seq_id)
            self._batcher.restore_admissions(seq.admission_order)
            if seq.is_finished:
                continue
            if self._tenants is not None:
                self._tenants.restore_active(seq.tenant)
            if seq.state is SequenceState.QUEUED:
                if len(seq.output_token_ids) >= seq.params.max_new_tokens:
                    self._finish(seq, FinishReason.MAX_LENGTH)  # nothing left to resume
                else:
                    queued.append(seq)
            elif worker is not None and seq.worker_id == worker.worker_id:
                worker.assigned[seq.seq_id] = None
            else:
                orphans.append(seq.seq_id)
        self._queue.adopt(queued)
        self._back_to_queue(orphans, "", RequeueReason.LOST)
        self._save()
        self._queue_changed()
        return adopted

    def disown(self, seq_ids: Iterable[int]) -> None:
        """Forget sequences another replica owns now: off the local queue and workers, out
        of the table, unsaved changes dropped. Nothing is finished or requeued; a worker
        that still reports one is told to evict it."""
        ids = frozenset(seq_ids)
        for seq_id in ids:
            seq = self._sequences.drop(seq_id)
            if seq is None:
                continue
            self._queue.remove(seq_id)
            worker = self._ledger.find(seq.worker_id or "")
            if worker is not None:
                worker.assigned.pop(seq_id, None)
            if not seq.is_finished and self._tenants is not None:
                self._tenants.deactivate(seq.tenant)
        self._changes.discard(ids)
        self._queue_changed()

    def owned_seq_ids(self) -> set[int]:
        """Every unfinished sequence this core holds (queued or assigned)."""
        return {seq.seq_id for seq in self._sequences if not seq.is_finished}

    def prefetch_wanted(self, depth: int, num_freeing: int = 0) -> int:
        """How many more queued sequences this core should hold (`prefetch_target`, with
        `num_freeing` places a report is about to free) less what its queue holds."""
        return max(0, self.prefetch_target(depth, num_freeing) - len(self._queue))

    def prefetch_target(self, depth: int, num_freeing: int = 0) -> int:
        """Queued sequences worth holding: the workers' free places (drained ones have
        none) plus `depth` ahead; nothing without a worker that takes work."""
        workers = [w for w in self._ledger if not (w.draining or w.drain_requested)]
        if not workers:
            return 0
        free = sum(max(0, w.settings.max_batch_size - len(w.assigned)) for w in workers)
        return free + num_freeing + depth

    def queued_tail(self, count: int) -> list[int]:
        """The last `count` queued ids in the policy's order (those to hand back first);
        what is unsaved is saved first, so the store holds them as they are."""
        self._save()
        if count <= 0:
            return []
        served = self._tenants.served if self._tenants is not None else _no_service
        order = list(self._queue.candidates(self._clock(), served))
        return order[-count:]

    def num_queued(self) -> int:
        return len(self._queue)

    def hand_out_incarnations_from(self, incarnation: int) -> None:
        """The next registration gets `incarnation` or more (replicas draw it from a
        database sequence, so numbers never repeat across replicas)."""
        self._last_incarnation = max(self._last_incarnation, incarnation - 1)

    # ----------------------------------------------------------------- reports

    def _new_tokens(self, worker: WorkerRecord,
                    report: WorkerReport) -> list[tuple[Sequence, tuple[int, ...]]]:
        """The tokens each update adds, changing nothing. An update with an offset keeps only
        what is new (a retried report repeats tokens already applied); one whose offset is
        past the tokens known for its sequence is refused (a gap means tokens were lost on
        the way), and with it the whole report."""
        new_tokens = []
        known: dict[int, int] = {}  # tokens per sequence since its admission, so far
        assigned, sequence = worker.assigned, self._sequences.get  # once per call: hot loop
        for index, update in enumerate(report.tokens):
            seq_id = update.seq_id
            if seq_id not in assigned:
                continue  # stale: the sequence left this worker
            seq = sequence(seq_id)
            num_known = known.get(seq_id)
            if num_known is None:
                num_known = len(seq.output_token_ids) - seq.num_generated_at_admission
            start = num_known if update.offset is None else update.offset
            if start > num_known:
                raise InvalidArgument(
                    f"tokens[{index}]: seq_id {seq_id} offset {start} is beyond the "
                    f"{num_known} tokens known for it since its admission to this worker "
                    f"(tokens {num_known}..{start - 1} were lost); nothing was applied"
                )
            # Past tokens of a retried report are dropped; a gap was refused above.
            token_ids = update.token_ids[num_known - start:]
            if token_ids:
                new_tokens.append((seq, token_ids))
                known[seq_id] = num_known + len(token_ids)
        return new_tokens

    def _apply_tokens(self, new_tokens: list[tuple[Sequence, tuple[int, ...]]]) -> None:
        served: Counter[str] = Counter()
        for seq, token_ids in new_tokens:
            seq.output_token_ids.extend(token_ids)
            self._changes.grown(seq)
            served[seq.tenant] += len(token_ids)
            self._observer.on_tokens(seq.seq_id, len(token_ids))
        self._batcher.serve(served)

    def _apply_finished(self, worker: WorkerRecord, report: WorkerReport) -> list[int]:
        """Finish what the worker finished; returns ids reported finished as PREEMPTED."""
        preempted = []
        for fin in report.finished:
            if fin.seq_id not in worker.assigned:
                continue  # stale: cancelled, or taken from this worker earlier
            if fin.reason is FinishReason.PREEMPTED:
                preempted.append(fin.seq_id)
                continue
            seq = self._sequences.get(fin.seq_id)
            # A count beyond what this assignment may generate is the worker's error: cap it.
            num_allowed = max(0, seq.params.max_new_tokens - seq.num_generated_at_admission)
            seq.num_generated = max(len(seq.output_token_ids), seq.num_generated_at_admission
                                    + min(fin.generated_tokens, num_allowed))
            if fin.reason is FinishReason.FAILED:
                seq.error_message = fin.error_message
            del worker.assigned[fin.seq_id]
            self._finish(seq, fin.reason)
        return preempted

    # ----------------------------------------------------------------- internals

    def _add_worker(self, registration: WorkerRegistration, incarnation: int) -> WorkerRecord:
        max_batch_size = min(registration.max_batch_size or self.config.max_batch_size,
                             self.config.max_worker_batch_size)
        if self._policy.name != "fifo":
            # Each running sequence decodes one token of the budget every iteration.
            max_batch_size = min(max_batch_size, self.config.token_budget)
        settings = WorkerSettings(
            chunk_size=self.config.chunk_size,
            max_batch_size=max_batch_size,
            prefill_reserve_pages=self.config.prefill_reserve_pages,
            lease_ttl_ms=self.config.lease_ttl_ms,
            incarnation=incarnation,
        )
        record = WorkerRecord(registration, settings, last_call_at=self._clock())
        self._ledger.add(record)
        self._observer.on_worker_registered(
            registration.worker_id, registration.total_kv_pages, registration.total_gdn_slots)
        return record

    def _worker_joined(self, worker: WorkerRecord) -> None:
        """The stored part of a worker changed (a registration, an operator drain)."""
        self._changes.worker_joined(StoredWorker(worker.registration, worker.drain_requested,
                                                 worker.incarnation))

    def _remove_worker(self, worker: WorkerRecord, reason: RequeueReason) -> list[int]:
        self._ledger.remove(worker.worker_id)
        requeued = self._requeue(worker, list(worker.assigned), reason)
        self._changes.worker_left(worker.worker_id)
        self._observer.on_worker_removed(worker.worker_id)
        return requeued

    def _expire_leases(self) -> list[str]:
        now = self._clock()
        self._forgive_own_stall(now)
        expired = self._ledger.expired(now)
        for worker in expired:
            self._remove_worker(worker, RequeueReason.LEASE_EXPIRED)
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

    def _save(self, sync: bool = False) -> frozenset[int]:
        """Save what changed; returns the ids a shared store said are another replica's
        now (forgotten here, the rest saved)."""
        disowned: frozenset[int] = frozenset()
        while True:
            try:
                self._changes.save(self._sequences.next_seq_id, self._last_incarnation, sync)
                return disowned
            except Disowned as err:
                if err.seq_ids <= disowned:
                    raise  # the store insists on ids already given up: a store bug
                disowned |= err.seq_ids
                self.disown(err.seq_ids)

    def _recover(self, state: StoredState) -> None:
        """Rebuild from the store: the queue in its order, workers with what they held.

        A recovered worker is registered as it was, with a fresh lease: its next
        SelectBatch reconciles (what it still holds stays, what it does not mention goes
        back to the head of the queue), and if it never calls its lease runs out.
        """
        self._last_incarnation = max([state.last_incarnation,
                                      *(w.incarnation for w in state.workers)])
        for stored in state.workers:
            record = self._add_worker(stored.registration, stored.incarnation)
            record.drain_requested = stored.drain_requested
        self._sequences.reserve_ids_below(state.next_seq_id)
        if self._tenants is not None:
            self._tenants.restore(state.tenant_service)
        now, wall_now = self._clock(), self._wall_clock()
        queued, orphans = [], []
        for stored in state.sequences:
            seq = self._sequences.restore(stored, now, wall_now)
            self._batcher.restore_admissions(seq.admission_order)
            if not seq.is_finished and self._tenants is not None:
                self._tenants.restore_active(seq.tenant)
            if seq.state is SequenceState.QUEUED:
                key = stored.progress.queue_key
                seq.queue_key = key if key is not None else 2**62 + seq.seq_id
                queued.append(seq)
            elif not seq.is_finished:
                worker = self._ledger.find(seq.worker_id or "")
                if worker is None:
                    orphans.append(seq.seq_id)
                else:
                    worker.assigned[seq.seq_id] = None
        self._sequences.restore_finished_order()
        self._queue.restore(sorted(queued, key=lambda s: s.queue_key))
        self._back_to_queue(orphans, "", RequeueReason.LOST)
        self._save()
        self._queue_changed()

    def _requeue(self, worker: WorkerRecord, seq_ids: list[int],
                 reason: RequeueReason) -> list[int]:
        """Take `seq_ids` from `worker` and put them back in the queue (FCFS: at the head,
        in order); returns the ids that went back to the queue.

        One that already generated max_new_tokens has nothing left to resume: it
        finishes with MAX_LENGTH instead (its resume spec would ask for <= 0 tokens).
        """
        for seq_id in seq_ids:
            del worker.assigned[seq_id]
        return self._back_to_queue(seq_ids, worker.worker_id, reason)

    def _back_to_queue(self, seq_ids: list[int], worker_id: str,
                       reason: RequeueReason) -> list[int]:
        requeued = []
        for seq_id in seq_ids:
            seq = self._sequences.get(seq_id)
            seq.num_generated = len(seq.output_token_ids)
            if seq.num_generated >= seq.params.max_new_tokens:
                self._finish(seq, FinishReason.MAX_LENGTH)
                continue
            requeued.append(seq)
            seq.state = SequenceState.QUEUED
            seq.worker_id = None
            seq.cursor = seq.prefilled_tokens = 0
            # Progress known only as a count cannot be resumed: restart from the tokens kept
            # (num_generated was reset to len(output_token_ids) above).
            seq.enqueued_at = self._clock()
            self._changes.touched(seq)
            self._observer.on_requeued(seq_id, worker_id, reason)
        if requeued:
            self._queue.requeue(requeued)
            self._queue_changed()
        return [seq.seq_id for seq in requeued]

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self._changes.forgotten(self._sequences.mark_finished(seq, reason))
        self._changes.touched(seq)
        if self._tenants is not None:
            self._tenants.deactivate(seq.tenant)
        self._observer.on_finished(seq.seq_id, reason)

    def _queue_changed(self) -> None:
        self._observer.on_queue_depth(len(self._queue))
        self._observer.on_queue_bands(self._queue.depth_by_band())

    def _evict_reason(self, seq_id: int) -> EvictReason:
        seq = self._sequences.get(seq_id)
        if seq is not None and seq.finish_reason is FinishReason.CANCELLED:
            return EvictReason.CANCELLED
        return EvictReason.NOT_ASSIGNED

    def _require(self, seq_id: int) -> Sequence:
        seq = self._sequences.get(seq_id)
        if seq is None:
            raise NotFound(f"seq_id {seq_id} is unknown (never submitted, or long finished)")
        return seq

    def _position(self, seq: Sequence) -> int:
        if seq.state is not SequenceState.QUEUED:
            return 0
        served = self._tenants.served if self._tenants is not None else _no_service
        return self._queue.position(seq.seq_id, self._clock(), served)

    def check_submit(self, params: SubmitParams) -> None:
        """InvalidArgument if `params` could never run under this config (a replica checks
        before it writes a submission to the shared queue)."""
        prompt_len = len(params.prompt_token_ids)
        if prompt_len == 0:
            raise InvalidArgument("prompt_token_ids must not be empty")
        if params.max_new_tokens == 0:
            raise InvalidArgument("max_new_tokens must be at least 1, got 0")
        limit = self.config.max_seq_len
        if prompt_len + params.max_new_tokens > limit:
            raise InvalidArgument(
                f"prompt_len + max_new_tokens = {prompt_len} + {params.max_new_tokens} = "
                f"{prompt_len + params.max_new_tokens} exceeds max_seq_len={limit}"
            )
        # Its spec, grown by every token it may generate, must fit in one decision.
        num_ids = prompt_len + params.max_new_tokens + len(params.stop_token_ids)
        if (spec_wire_bytes(num_ids, params.adapter_id)
                > self._max_decision_bytes - DECISION_FIXED_BYTES):
            raise InvalidArgument(
                f"prompt_len + max_new_tokens + stop_token_ids = {num_ids} token ids may not "
                f"fit in one decision of at most {self._max_decision_bytes} bytes "
                "(--max-message-bytes); send a shorter prompt or raise the limit"
            )


def _no_service(tenant: str) -> float:
    return 0.0


def _without(decision: Decision, disowned: frozenset[int], reported: set[int]) -> Decision:
    """`decision` less the sequences given up while it was saved (another replica owns
    them): not run here, and evicted if the worker holds them."""
    return replace(
        decision,
        prefill=tuple(c for c in decision.prefill if c.seq_id not in disowned),
        decode=tuple(s for s in decision.decode if s not in disowned),
        preempt=tuple(s for s in decision.preempt if s not in disowned),
        evict=tuple(dict.fromkeys([*decision.evict, *(disowned & reported)])),
    )
