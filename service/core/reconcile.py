"""Report reconciliation (docs/contract.md rule 1): a worker's report applied to the core's
tables before its batch is decided.

New tokens are appended (a retried report's repeats dropped, a gap refused before any
change), finished sequences finish, preempted and lost ones go back to the head of the
queue, the worker's resume points take the report's cache delta, cache misses go back
to the queue to be admitted again, and ids the worker holds that are no longer its are
listed for eviction.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from service.core.changes import ChangeSet
from service.core.errors import InvalidArgument
from service.core.ledger import WorkerRecord
from service.core.lifecycle import Lifecycle
from service.core.observer import EvictReason, RequeueReason, SchedulerObserver
from service.core.sequences import Sequence, SequenceTable
from service.core.types import FinishReason, TokenUpdate, WorkerReport
from service.core.vocabulary import PreemptReason


@dataclass(frozen=True)
class Reconciled:
    """What a report left for the decision."""

    reported: frozenset[int]  # ids the report lists waiting or running
    evict: tuple[int, ...]  # of those, the ones not (or no longer) this worker's


class Reconciler:
    """Applies worker reports to the sequence table."""

    def __init__(self, sequences: SequenceTable, changes: ChangeSet,
                 observer: SchedulerObserver, lifecycle: Lifecycle,
                 clock: Callable[[], float]) -> None:
        self._sequences = sequences
        self._changes = changes
        self._observer = observer
        self._lifecycle = lifecycle
        self._clock = clock

    def apply(self, worker: WorkerRecord, report: WorkerReport) -> Reconciled:
        """Apply `report` (validated) to `worker`; InvalidArgument, with nothing
        changed, if its tokens leave a gap."""
        new_tokens = self._new_tokens(worker, report)  # refuses a gap before any change
        worker.last_call_at = self._clock()
        worker.iteration += 1
        worker.kv_free_pages = report.kv_free_pages
        worker.gdn_free_slots = report.gdn_free_slots
        worker.draining = report.draining

        self._apply_tokens(new_tokens)
        preempted = [*self._apply_finished(worker, report), *report.preempted]
        reported = frozenset(report.waiting) | frozenset(report.running)
        mentioned = (reported | {f.seq_id for f in report.finished} | set(report.preempted)
                     | set(report.cache_misses))
        # An id may be named twice, or finished after being preempted: requeue each once.
        requeue_ids = [s for s in dict.fromkeys(preempted) if s in worker.assigned]
        misses = self._apply_cache(worker, report, reported, frozenset(requeue_ids))
        lost = [s for s in worker.assigned if s not in mentioned]
        # Lost first, so the preempted ones end up at the very head, in the order given;
        # a cache miss goes back where an admitted sequence goes, the head, to be offered
        # a first chunk again.
        self._lifecycle.requeue(worker, lost, RequeueReason.LOST)
        self._lifecycle.requeue(worker, misses, RequeueReason.CACHE_MISS)
        self._lifecycle.requeue(worker, requeue_ids, RequeueReason.PREEMPTED)
        for seq_id in requeue_ids:
            self._observer.on_preempted(seq_id, worker.worker_id, PreemptReason.WORKER)

        evict = tuple(s for s in (*report.waiting, *report.running) if s not in worker.assigned)
        for seq_id in evict:
            self._observer.on_evicted(seq_id, worker.worker_id, self._evict_reason(seq_id))
        return Reconciled(reported, evict)

    def _apply_cache(self, worker: WorkerRecord, report: WorkerReport,
                     reported: frozenset[int], preempted: frozenset[int]) -> list[int]:
        """Apply the report's resume-point delta; returns its cache misses (assigned ids
        the worker holds no longer: nothing ran for them), whose resume points are
        forgotten so that the next first chunk starts from another one, or from 0."""
        resume = worker.resume_points
        num_removed = resume.apply(report.cache)
        misses = []
        for seq_id in dict.fromkeys(report.cache_misses):
            if seq_id not in worker.assigned or seq_id in reported or seq_id in preempted:
                continue  # stale (a retried report), or the worker holds it after all
            seq = self._sequences.get(seq_id)
            if seq.cached_tokens and seq.prompt_hashes is not None and resume.block_tokens:
                block = seq.cached_tokens // resume.block_tokens - 1
                resume.forget(seq.prompt_hashes.hashes[block])
            misses.append(seq_id)
            self._observer.on_cache_miss(seq_id, worker.worker_id)
        if resume.block_tokens:
            self._observer.on_resume_points(worker.worker_id, len(resume), num_removed)
        return misses

    def _new_tokens(self, worker: WorkerRecord,
                    report: WorkerReport) -> list[tuple[Sequence, tuple[int, ...], TokenUpdate]]:
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
                new_tokens.append((seq, token_ids, update))
                known[seq_id] = num_known + len(token_ids)
        return new_tokens

    def _apply_tokens(self, new_tokens: list[tuple[Sequence, tuple[int, ...], TokenUpdate]]) -> None:
        served: Counter[str] = Counter()
        for seq, token_ids, update in new_tokens:
            if seq.output_logprobs is None:
                seq.output_token_ids.extend(token_ids)
            else:
                num_past = len(update.token_ids) - len(token_ids)
                seq.add_tokens(token_ids, update.logprobs[num_past:], update.prompt_logprobs)
            self._changes.grown(seq)
            served[seq.tenant] += len(token_ids)
            self._observer.on_tokens(seq.seq_id, len(token_ids))
        self._lifecycle.serve(served)

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
            self._lifecycle.finish(seq, fin.reason)
        return preempted

    def _evict_reason(self, seq_id: int) -> EvictReason:
        seq = self._sequences.get(seq_id)
        if seq is not None and seq.finish_reason is FinishReason.CANCELLED:
            return EvictReason.CANCELLED
        return EvictReason.NOT_ASSIGNED
