"""Report reconciliation (docs/contract.md rule 1): a worker's report applied to the core's
tables before its batch is decided.

New tokens are appended (a retried report's repeats dropped, a gap refused before any
change), finished sequences finish, preempted and lost ones go back to the head of the
queue, the worker's resume points take the report's cache delta, cache misses go back
to the queue to be admitted again, and ids the worker holds that are no longer its are
listed for eviction.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable
from functools import partial
from operator import attrgetter, itemgetter

from service.core.decide.batcher import decides_later
from service.core.decide.disaggregation import Disaggregation
from service.core.errors import InvalidArgument
from service.core.observer import EvictReason, RequeueReason
from service.core.tables.ledger import WorkerRecord
from service.core.tables.lifecycle import Lifecycle
from service.core.tables.sequences import Sequence, compact
from service.core.tables.steady import NewTokens, SteadyStep
from service.core.tables.tables import Tables
from service.core.types import FinishReason, TokenRuns, TokenUpdate, WorkerReport
from service.core.vocabulary import PreemptReason

_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_OUTPUT, _SEQ_ID, _TENANT = (
    attrgetter("output_token_ids"),
    attrgetter("seq_id"),
    attrgetter("params.tenant"),
)
_EXTEND = array.extend


# Entries of sequences that asked for logprobs, by index in the new tokens: the update
# that carries them (None for packed runs) and how many of its tokens were past.
_Logprobs = dict[int, tuple["TokenUpdate | None", int]]


def _consume(iterator) -> None:
    """Run `iterator` to its end, keeping nothing (in C)."""
    deque(iterator, maxlen=0)


class Reconciler:
    """Applies worker reports to the sequence table."""

    def __init__(
        self, tables: Tables, lifecycle: Lifecycle, steady: SteadyStep, handoffs: Disaggregation
    ) -> None:
        self._sequences = tables.sequences
        self._changes = tables.changes
        self._observer = tables.observer
        self._clock = tables.clock
        self._lifecycle = lifecycle
        self._steady = steady
        self._handoffs = handoffs

    def apply(
        self, worker: WorkerRecord, report: WorkerReport, reported: frozenset[int]
    ) -> tuple[int, ...]:
        """Apply `report` (validated; `reported`: its waiting and running ids) to
        `worker`; returns the reported ids to evict (not, or no longer, this worker's).
        InvalidArgument, with nothing changed, if its tokens leave a gap."""
        if report.finished:
            _check_finish_counts(worker, report)  # before anything changes
        # The tokens first: a report they refuse changes nothing.
        self._steady.apply_tokens(worker, report, self._general_tokens)
        worker.last_call_at = self._clock()
        busy = bool(worker.assigned)  # it held sequences since its previous call
        worker.iteration += 1
        worker.kv_free_pages = report.kv_free_pages
        worker.gdn_free_slots = report.gdn_free_slots
        worker.draining = report.draining
        # Handoffs before the lists: a sequence imported is the receiver's when they are read.
        handed_evict = (
            self._handoffs.apply_results(worker, report.handoffs) if report.handoffs else ()
        )

        preempted = [*self._apply_finished(worker, report), *report.preempted]
        assigned = worker.assigned
        # An id may be named twice, or finished after being preempted: requeue each once.
        requeue_ids = [s for s in dict.fromkeys(preempted) if s in assigned]
        misses = self._apply_cache(worker, report, reported, frozenset(requeue_ids))
        # Reported ids that are not (or no longer) this worker's; the lost are the
        # assigned ones the report does not mention. Set operations in C first: when
        # every assigned id is reported, len(reported) - len(strays) == len(assigned).
        strays = reported.difference(assigned)
        lost: list[int] = []
        if len(reported) - len(strays) != len(assigned):
            mentioned = (
                reported
                | {f.seq_id for f in report.finished}
                | set(report.preempted)
                | set(report.cache_misses)
            )
            lost = [s for s in assigned if s not in mentioned]
        # Lost first, so the preempted ones end up at the very head, in the order given;
        # a cache miss goes back where an admitted sequence goes, the head, to be offered
        # a first chunk again.
        for seq_ids, reason in (
            (lost, RequeueReason.LOST),
            (misses, RequeueReason.CACHE_MISS),
            (requeue_ids, RequeueReason.PREEMPTED),
        ):
            if seq_ids:
                self._lifecycle.requeue(worker, seq_ids, reason)
        for seq_id in requeue_ids:
            self._observer.on_preempted(seq_id, worker.worker_id, PreemptReason.WORKER)

        evict = (
            tuple(s for s in (*report.waiting, *report.running) if s in strays) if strays else ()
        )
        if handed_evict:
            evict = tuple(dict.fromkeys([*evict, *handed_evict]))
        for seq_id in evict:
            self._observer.on_evicted(seq_id, worker.worker_id, self._evict_reason(seq_id))
        if not decides_later(worker, report, evict):
            # A call for placement (its wait bound); a deferred report admits nothing.
            worker.call_gaps.called(worker.last_call_at, busy)
        return evict

    def _apply_cache(
        self,
        worker: WorkerRecord,
        report: WorkerReport,
        reported: frozenset[int],
        preempted: frozenset[int],
    ) -> list[int]:
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

    def _general_tokens(
        self,
        worker: WorkerRecord,
        report: WorkerReport,
    ) -> tuple[NewTokens, dict[int, Sequence], _Logprobs, dict[str, int]]:
        """The report's tokens by the rules, sequence by sequence (`_new_tokens`, then
        `_apply_tokens`); also the tokens served per tenant."""
        new_tokens, grown, logprobs = self._new_tokens(worker, report)  # refuses a gap first
        served = (
            self._apply_tokens(worker.worker_id, new_tokens, grown, logprobs) if new_tokens else {}
        )
        return new_tokens, grown, logprobs, served

    def _new_tokens(
        self,
        worker: WorkerRecord,
        report: WorkerReport,
    ) -> tuple[NewTokens, dict[int, Sequence], _Logprobs]:
        """The tokens each update adds, the sequences they add to by seq_id, and for the
        entries of sequences that asked for logprobs (by index) the update that carries
        them (None for packed runs, which carry none) with the number of its tokens
        dropped as past; changing nothing. An update with an offset keeps only what is
        new (a retried report repeats tokens already applied); one whose offset is past
        the tokens known for its sequence is refused (a gap means tokens were lost on the
        way), and with it the whole report."""
        new_tokens: NewTokens = []
        grown: dict[int, Sequence] = {}
        logprobs: _Logprobs = {}
        assigned = worker.assigned.get  # once per call: hot loop
        for update in report.tokens:
            seq_id = update.seq_id
            seq = assigned(seq_id)
            if seq is None:
                continue  # stale: the sequence left this worker
            # Tokens since its admission, so far (with this report's earlier updates);
            # inline, not a call: this loop runs once per sequence.
            num_known = len(seq.output_token_ids) - seq.num_generated_at_admission
            if seq_id in grown:
                num_known += sum(len(t) for s, t in new_tokens if s is seq)
            token_ids = update.token_ids
            start = update.offset
            if start is not None and start != num_known:
                # The update's index is looked up only for a refusal's message.
                where = partial(report.tokens.index, update)
                token_ids = token_ids[_num_past("tokens", where, seq_id, start, num_known) :]
            if token_ids:
                if seq.output_logprobs is not None:
                    logprobs[len(new_tokens)] = (update, len(update.token_ids) - len(token_ids))
                new_tokens.append((seq, token_ids))
                grown[seq_id] = seq
        runs = report.token_runs
        if runs.seq_ids:
            self._new_runs(worker, runs, new_tokens, grown, logprobs)
        return new_tokens, grown, logprobs

    @staticmethod
    def _new_runs(
        worker: WorkerRecord,
        runs: TokenRuns,
        new_tokens: NewTokens,
        grown: dict[int, Sequence],
        logprobs: _Logprobs,
    ) -> None:
        """`_new_tokens` for the packed runs (validated: the arrays line up), added to
        `new_tokens`, `grown` and `logprobs` (a None entry for a sequence that asked for
        them: runs carry none); the same rules, the same refusal of a gap."""
        assigned = worker.assigned.get
        all_ids, counts, offsets = compact(runs.token_ids, "token_ids"), runs.counts, runs.offsets
        end = 0
        for index, seq_id in enumerate(runs.seq_ids):
            begin = end
            end += counts[index] if counts else 1
            seq = assigned(seq_id)
            if seq is None:
                continue  # stale: the sequence left this worker
            num_known = len(seq.output_token_ids) - seq.num_generated_at_admission
            if seq_id in grown:
                num_known += sum(len(t) for s, t in new_tokens if s is seq)
            if offsets and offsets[index] != num_known:
                where = partial(int, index)  # the index itself
                begin += _num_past("token_offsets", where, seq_id, offsets[index], num_known)
            if begin < end:
                if seq.output_logprobs is not None:
                    logprobs[len(new_tokens)] = (None, 0)  # the runs carry no logprobs
                new_tokens.append((seq, all_ids[begin:end]))
                grown[seq_id] = seq

    def _apply_tokens(
        self, worker_id: str, new_tokens: NewTokens, grown: dict[int, Sequence], logprobs: _Logprobs
    ) -> dict[str, int]:
        """Add `new_tokens`; returns the tokens served per tenant."""
        # Per-sequence steps as map() over C callables: no Python frame per sequence.
        seqs = list(map(_FIRST, new_tokens))
        runs = list(map(_SECOND, new_tokens))
        counts = list(map(len, runs))
        if logprobs:  # some sequence asked for logprobs: they go with its tokens
            for index, (seq, token_ids) in enumerate(new_tokens):
                update, num_past = logprobs.get(index, (None, 0))
                if update is None:
                    seq.add_tokens(token_ids)
                else:
                    seq.add_tokens(token_ids, update.logprobs[num_past:], update.prompt_logprobs)
        else:
            _consume(map(_EXTEND, map(_OUTPUT, seqs), runs))
        self._changes.grown_all(grown)
        seq_ids = list(grown) if len(grown) == len(seqs) else list(map(_SEQ_ID, seqs))
        self._observer.on_tokens_reported(worker_id, seq_ids, counts)
        tenants = list(map(_TENANT, seqs))
        if tenants.count(tenants[0]) == len(tenants):  # one tenant (the common case)
            served = {tenants[0]: sum(counts)}
        else:
            served = {}
            for tenant, num in zip(tenants, counts):
                served[tenant] = served.get(tenant, 0) + num
        self._lifecycle.serve(served)
        return served

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
            seq.num_generated = max(
                len(seq.output_token_ids),
                seq.num_generated_at_admission + min(fin.generated_tokens, num_allowed),
            )
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


def _check_finish_counts(worker: WorkerRecord, report: WorkerReport) -> None:
    """InvalidArgument, naming `generated_tokens`, for a finish of one of `worker`'s
    sequences that counts more tokens for this assignment than the worker reported for it,
    this report's included: the clients' streams hold only the reported tokens, so the
    count would claim tokens nobody can read. A lower count is not an error (an older
    worker sends 0): the reported tokens stand."""
    ends: dict[int, int] = {}
    for index, fin in enumerate(report.finished):
        seq = worker.assigned.get(fin.seq_id)
        if seq is None or fin.reason is FinishReason.PREEMPTED:
            continue  # stale, or back to the queue: the count is not read
        if not ends:
            ends = _reported_ends(worker, report)
        num_known = ends.get(fin.seq_id)
        if num_known is None:
            num_known = len(seq.output_token_ids) - seq.num_generated_at_admission
        if fin.generated_tokens > num_known:
            raise InvalidArgument(
                f"finished[{index}].generated_tokens: seq_id {fin.seq_id} is counted "
                f"{fin.generated_tokens} tokens, but {num_known} were reported for it since "
                "its admission to this worker (this report's included); send the finish "
                "with the tokens it counts; nothing was applied"
            )


def _reported_ends(worker: WorkerRecord, report: WorkerReport) -> dict[int, int]:
    """The tokens known for each of `worker`'s sequences that `report` adds tokens to,
    since its admission, once the report is applied (offsets as the rules read them; a
    gap is refused later, by the tokens' own check)."""
    ends: dict[int, int] = {}

    def add(seq_id: int, offset: int | None, count: int) -> None:
        seq = worker.assigned.get(seq_id)
        if seq is None:
            return
        known = ends.get(seq_id)
        if known is None:
            known = len(seq.output_token_ids) - seq.num_generated_at_admission
        ends[seq_id] = known + count if offset is None else max(known, offset + count)

    for update in report.tokens:
        add(update.seq_id, update.offset, len(update.token_ids))
    runs = report.token_runs
    counts, offsets = runs.counts, runs.offsets
    for index, seq_id in enumerate(runs.seq_ids):
        add(seq_id, offsets[index] if offsets else None, counts[index] if counts else 1)
    return ends


def _num_past(
    field: str, index: Callable[[], int], seq_id: int, offset: int, num_known: int
) -> int:
    """The one check of a token offset, for both wire forms (a TokenUpdate's `offset`,
    packed runs' `token_offsets`): how many leading tokens a retried report repeats (to
    drop), for an offset below the tokens known; InvalidArgument, naming `field[index()]`,
    for one beyond them (tokens were lost on the way: the whole report is refused)."""
    if offset > num_known:
        raise InvalidArgument(
            f"{field}[{index()}]: seq_id {seq_id} offset {offset} is beyond the {num_known} "
            f"tokens known for it since its admission to this worker (tokens "
            f"{num_known}..{offset - 1} were lost); nothing was applied"
        )
    return num_known - offset
