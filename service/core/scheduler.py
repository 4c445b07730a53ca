"""The scheduling core: queue, sequence table, worker ledger and policy behind one API.

Single-threaded by design: the caller serializes calls (the servicer holds one lock).
No gRPC, no Prometheus: adapters convert messages and listen through an observer.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from service.core.config import SchedulerConfig
from service.core.errors import InvalidArgument, NotFound, QueueFull, Superseded, UnknownWorker
from service.core.ledger import WorkerLedger, WorkerRecord
from service.core.observer import EvictReason, RequeueReason, SchedulerObserver
from service.core.policy import Policy, make_policy
from service.core.queue import AdmissionQueue
from service.core.sequences import Sequence, SequenceTable
from service.core.store import (
    StateChanges, StateStore, StoredState, StoredWorker, StoreError, TokenAppend,
)
from service.core.types import (
    Decision, FinishReason, PrefillChunk, SchedulerStatus, SequenceInfo, SequenceState,
    SubmitParams, SubmitResult, WorkerRegistration, WorkerReport, WorkerSettings, WorkerStatus,
)


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
    or finished; a sequence that leaves a worker unfinished goes back to the head of
    the queue; no id is ever reused.

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
        max_finished_retained: int = 100_000,
        store: StateStore | None = None,
        stall_seconds: float | None = None,
    ) -> None:
        """`stall_seconds`: when lease checks (every call, and a caller's sweeper) are this
        far apart, the scheduler itself stood still (frozen, paused, starved): that time
        is not counted against the workers' leases. None: every gap counts (tests that
        move a fake clock by hand)."""
        self.config = config.validate()
        self._policy: Policy = make_policy(config)
        self._observer = observer or SchedulerObserver()
        self._clock = clock
        self._queue = AdmissionQueue()
        self._sequences = SequenceTable(max_finished_retained)
        self._ledger = WorkerLedger()
        self._store = store
        self._stall_seconds = stall_seconds
        self._last_lease_check: float | None = None
        # The latest incarnation handed out (saved with every change of the workers).
        self._last_incarnation = 0
        # What changed since the last save (see _save).
        self._created: dict[int, SubmitParams] = {}
        self._touched: dict[int, Sequence] = {}  # progress changed
        self._grown: dict[int, Sequence] = {}  # output tokens added
        self._forgotten: list[int] = []
        self._worker_changes: dict[str, WorkerRecord | None] = {}
        if store is not None:
            self._recover(store.load())

    # ----------------------------------------------------------------- clients

    def submit(self, params: SubmitParams) -> SubmitResult:
        """Enqueue a sequence at the tail; a known request_id returns its first seq_id."""
        known = self._sequences.by_request_id(params.request_id)
        if known is not None:
            return SubmitResult(known.seq_id, self._position(known))
        self._validate_submit(params)
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
        seq = self._sequences.create(params, self._clock())
        position = len(self._queue)
        self._queue.push_back(seq.seq_id, params.tenant)
        self._created[seq.seq_id] = params
        self._touch(seq)
        try:
            self._save(sync=True)  # acknowledged to the client: must survive a power loss
        except StoreError:
            self._queue.remove(seq.seq_id)
            self._sequences.discard_new(seq)
            self._created.pop(seq.seq_id, None)
            self._touched.pop(seq.seq_id, None)
            raise
        self._observer.on_submitted(seq.seq_id, params.tenant, seq.prompt_len)
        self._observer.on_queue_depth(len(self._queue))
        return SubmitResult(seq.seq_id, position)

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
            self._observer.on_queue_depth(len(self._queue))
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
        self._worker_changes[registration.worker_id] = record
        self._save()
        return record.settings

    def deregister_worker(self, worker_id: str, incarnation: int = 0) -> int:
        """Leave cleanly; returns how many sequences went back to the head of the queue.

        `incarnation` 0 means the latest; an older one is refused (Superseded).
        """
        self._save()
        worker = self._ledger.get(worker_id)
        _check_incarnation(worker, incarnation)
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
        self._worker_changes[worker_id] = worker
        self._save()
        return len(worker.assigned)

    def expire_leases(self) -> list[str]:
        """Drop workers silent for longer than their lease; returns their ids."""
        dropped = self._expire_leases()
        self._save()
        return dropped

    def select_batch(self, report: WorkerReport) -> Decision:
        """Apply one worker's report, then decide its batch (contract rules 1-7)."""
        self.expire_leases()  # saved before anything below can refuse the report
        worker = self._ledger.get(report.worker_id)
        _check_incarnation(worker, report.incarnation)
        _validate_report(report)
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

        evict = [s for s in (*report.waiting, *report.running) if s not in worker.assigned]
        for seq_id in evict:
            self._observer.on_evicted(seq_id, worker.worker_id, self._evict_reason(seq_id))

        prefill = self._admit(worker, report, exclude=reported)
        decode = []
        for seq_id in report.running:
            if seq_id in worker.assigned:
                seq = self._sequences.get(seq_id)
                if seq.state is not SequenceState.DECODING:
                    seq.state = SequenceState.DECODING
                    seq.prefilled_tokens = seq.spec_prompt_len()
                    self._touch(seq)
                decode.append(seq_id)
        for seq_id in report.waiting:
            if seq_id in worker.assigned:
                prefill.append(self._continuation(self._sequences.get(seq_id)))

        decision = Decision(tuple(prefill), tuple(decode), tuple(evict), worker.iteration)
        self._save()
        self._observer.on_decision(report, decision)
        return decision

    # ----------------------------------------------------------------- internals

    def _add_worker(self, registration: WorkerRegistration, incarnation: int) -> WorkerRecord:
        settings = WorkerSettings(
            chunk_size=self.config.chunk_size,
            max_batch_size=min(registration.max_batch_size or self.config.max_batch_size,
                               self.config.max_worker_batch_size),
            prefill_reserve_pages=self.config.prefill_reserve_pages,
            lease_ttl_ms=self.config.lease_ttl_ms,
            incarnation=incarnation,
        )
        record = WorkerRecord(registration, settings, last_call_at=self._clock())
        self._ledger.add(record)
        self._observer.on_worker_registered(
            registration.worker_id, registration.total_kv_pages, registration.total_gdn_slots)
        return record

    def _remove_worker(self, worker: WorkerRecord, reason: RequeueReason) -> list[int]:
        self._ledger.remove(worker.worker_id)
        requeued = self._requeue(worker, list(worker.assigned), reason)
        self._worker_changes[worker.worker_id] = None
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

    def _touch(self, seq: Sequence) -> None:
        """Mark `seq` as changed: the next _save writes its progress and new tokens."""
        self._touched[seq.seq_id] = seq

    def _save(self, sync: bool = False) -> None:
        """Hand everything changed since the last save to the store, as one change.

        On StoreError nothing is marked saved, so the next save carries it again.
        """
        if self._store is None:
            self._clear_changes()
            return
        if not (self._touched or self._grown or self._created or self._forgotten
                or self._worker_changes):
            return
        grown = [seq for seq in self._grown.values()
                 if len(seq.output_token_ids) > seq.num_saved_tokens]
        changes = StateChanges(
            created=tuple(self._created.items()),
            progress=tuple(seq.progress(self._queue.key(seq.seq_id)
                                        if seq.seq_id in self._queue else None)
                           for seq in self._touched.values()),
            tokens=tuple(
                TokenAppend(seq.seq_id, seq.num_saved_tokens,
                            tuple(seq.output_token_ids[seq.num_saved_tokens:]))
                for seq in grown
            ),
            # Every finish touches its sequence, and nothing touches it after.
            final_outputs=tuple((seq.seq_id, tuple(seq.output_token_ids))
                                for seq in self._touched.values() if seq.is_finished),
            forgotten=tuple(self._forgotten),
            workers_joined=tuple(StoredWorker(w.registration, w.drain_requested, w.incarnation)
                                 for w in self._worker_changes.values() if w is not None),
            workers_left=tuple(w for w, r in self._worker_changes.items() if r is None),
            next_seq_id=self._sequences.next_seq_id if self._created else None,
            last_incarnation=self._last_incarnation if self._worker_changes else None,
            sync=sync,
        )
        self._store.save(changes)
        for seq in grown:
            seq.num_saved_tokens = len(seq.output_token_ids)
        self._clear_changes()

    def _clear_changes(self) -> None:
        self._touched.clear()
        self._grown.clear()
        self._created.clear()
        self._forgotten.clear()
        self._worker_changes.clear()

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
        queued, orphans = [], []
        for stored in state.sequences:
            seq = self._sequences.restore(stored, self._clock())
            if seq.state is SequenceState.QUEUED:
                key = stored.progress.queue_key
                queued.append((seq.seq_id, seq.params.tenant,
                               key if key is not None else 2**62 + seq.seq_id))
            elif not seq.is_finished:
                worker = self._ledger.find(seq.worker_id or "")
                if worker is None:
                    orphans.append(seq.seq_id)
                else:
                    worker.assigned[seq.seq_id] = None
        self._sequences.restore_finished_order()
        self._queue.restore(queued)
        self._back_to_queue(orphans, "", RequeueReason.LOST)
        self._save()
        self._observer.on_queue_depth(len(self._queue))

    def _admit(self, worker: WorkerRecord, report: WorkerReport,
               exclude: set[int]) -> list[PrefillChunk]:
        budget = self._policy.admission_budget(
            max_batch_size=worker.settings.max_batch_size,
            num_active=len(report.waiting) + len(report.running),
            kv_free_pages=report.kv_free_pages,
            gdn_free_slots=report.gdn_free_slots,
            draining=report.draining or worker.drain_requested,
        )
        chunks: list[PrefillChunk] = []
        if budget.max_new_seqs > 0:
            for seq_id in self._queue:
                seq = self._sequences.get(seq_id)
                if seq_id in exclude or not worker.can_run(seq.params.adapter_id):
                    continue
                chunks.append(self._first_chunk(worker, seq))
                if len(chunks) == budget.max_new_seqs:
                    break
            for chunk in chunks:
                self._queue.remove(chunk.seq_id)
            if chunks:
                self._observer.on_queue_depth(len(self._queue))
        if len(self._queue) > 0 and len(chunks) == budget.max_new_seqs:
            self._observer.on_admission_blocked(worker.worker_id, budget.limited_by)
        return chunks

    def _first_chunk(self, worker: WorkerRecord, seq: Sequence) -> PrefillChunk:
        spec = seq.spec()
        seq.state = SequenceState.PREFILLING
        seq.worker_id = worker.worker_id
        seq.prefilled_tokens = 0
        seq.num_generated_at_admission = len(seq.output_token_ids)
        seq.num_generated = len(seq.output_token_ids)
        seq.cursor = self._policy.chunk_len(cursor=0, prompt_len=len(spec.prompt_token_ids))
        worker.assigned[seq.seq_id] = None
        self._touch(seq)
        self._observer.on_admitted(seq.seq_id, worker.worker_id,
                                   max(0.0, self._clock() - seq.enqueued_at))
        return PrefillChunk(seq.seq_id, 0, seq.cursor, spec)

    def _continuation(self, seq: Sequence) -> PrefillChunk:
        # The worker asks for more, so the chunk handed out before is done.
        seq.prefilled_tokens = seq.cursor
        length = self._policy.chunk_len(cursor=seq.cursor, prompt_len=seq.spec_prompt_len())
        chunk = PrefillChunk(seq.seq_id, seq.cursor, length)
        seq.cursor += length
        self._touch(seq)
        return chunk

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
        for seq, token_ids in new_tokens:
            seq.output_token_ids.extend(token_ids)
            self._grown[seq.seq_id] = seq
            self._observer.on_tokens(seq.seq_id, len(token_ids))

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

    def _requeue(self, worker: WorkerRecord, seq_ids: list[int],
                 reason: RequeueReason) -> list[int]:
        """Take `seq_ids` from `worker` and put them at the head of the queue, in order;
        returns the ids that went back to the queue.

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
            self._touch(seq)
            self._observer.on_requeued(seq_id, worker_id, reason)
        if requeued:
            self._queue.push_front((seq.seq_id, seq.params.tenant) for seq in requeued)
            self._observer.on_queue_depth(len(self._queue))
        return [seq.seq_id for seq in requeued]

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self._forgotten.extend(self._sequences.mark_finished(seq, reason))
        self._touch(seq)
        self._observer.on_finished(seq.seq_id, reason)

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
        return self._queue.position(seq.seq_id) if seq.state is SequenceState.QUEUED else 0

    def _validate_submit(self, params: SubmitParams) -> None:
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


def _check_incarnation(worker: WorkerRecord, incarnation: int) -> None:
    """Refuse a call from an incarnation other than the registered one (0: the latest)."""
    if incarnation in (0, worker.incarnation):
        return
    if incarnation < worker.incarnation:
        raise Superseded(
            f"superseded: worker_id {worker.worker_id!r} incarnation {incarnation} was "
            f"replaced by incarnation {worker.incarnation} (a later RegisterWorker with the "
            "same worker_id: two processes share it); this call changed nothing"
        )
    raise UnknownWorker(
        f"worker_id {worker.worker_id!r} incarnation {incarnation} is unknown here (the "
        f"registered one is {worker.incarnation}; the scheduler's state is older than that "
        "registration): call RegisterWorker again"
    )


def _validate_report(report: WorkerReport) -> None:
    """Reject contradictory reports before any state changes."""
    seen: set[int] = set()
    for field_name, ids in (("waiting", report.waiting), ("running", report.running)):
        for seq_id in ids:
            if seq_id in seen:
                raise InvalidArgument(
                    f"seq_id {seq_id} appears more than once in waiting/running "
                    f"(second time in {field_name})"
                )
            seen.add(seq_id)
    for fin in report.finished:
        if fin.seq_id in seen:
            raise InvalidArgument(f"seq_id {fin.seq_id} is reported both finished and active")
    for seq_id in report.preempted:
        if seq_id in seen:
            raise InvalidArgument(f"seq_id {seq_id} is reported both preempted and active")
