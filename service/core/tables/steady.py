"""The steady step's fast path, owned by one class (`SteadyStep`).

A worker decoding a fixed set of sequences sends the same report every step but for
one new token each: the same packed runs, offsets one higher. Applying such a report
and deciding its batch sequence by sequence costs a Python pass per sequence on each
side; kept from the step before (`SteadyRuns`, on the WorkerRecord), the next report is
checked with list comparisons in C and applied with one append each, and its decision
reads the running sequences and their pages from what the last pass found.

Only this module reads or writes `WorkerRecord.steady_runs` (a `SteadyRuns`, defined
beside the record in tables/ledger.py): the Reconciler hands it a
report's tokens (`SteadyStep.apply_tokens`), the Batcher asks it for the running part of
a decision (`SteadyStep.running`) and tells it of an admission (`SteadyStep.forget`).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from itertools import repeat
from operator import add, attrgetter, is_, itemgetter, sub
from typing import TYPE_CHECKING

from service.core.tables.ledger import SteadyRuns
from service.core.tables.sequences import compact
from service.core.types import SequenceState, WorkerReport

if TYPE_CHECKING:
    from service.core.tables.ledger import WorkerRecord
    from service.core.tables.lifecycle import Lifecycle
    from service.core.tables.sequences import Sequence
    from service.core.tables.tables import Tables

_FIRST = itemgetter(0)
_OUTPUT = attrgetter("output_token_ids")
_AT_ADMISSION = attrgetter("num_generated_at_admission")
_APPEND = array.append
_DECODING = SequenceState.DECODING

# New tokens of a report, as the general path found them: (record, its new tokens).
NewTokens = list[tuple["Sequence", "tuple[int, ...] | array"]]


@dataclass(frozen=True, slots=True)
class Running:
    """The running part of a decision: the reported running sequences still assigned
    (records and ids), those of them not yet DECODING, and how many start a KV page at
    their next decode."""

    seqs: tuple[Sequence, ...]
    seq_ids: Collection[int]
    started: list[Sequence]
    num_decode_pages: int


class SteadyStep:
    """The one owner of the steady-step fast path, for both sides of a SelectBatch.

    `match`/`apply`/`remember` are the report's side: whether a report's tokens are the
    kept step once more, applying them so, and keeping what the next report needs after
    the general rules applied one. `running` is the decision's side, `forget` drops what
    is kept when the worker is given a new sequence.
    """

    def __init__(self, tables: Tables, lifecycle: Lifecycle) -> None:
        self._changes = tables.changes
        self._observer = tables.observer
        self._lifecycle = lifecycle

    # ------------------------------------------------------------- report side

    def apply_tokens(
        self,
        worker: WorkerRecord,
        report: WorkerReport,
        general: Callable[
            [WorkerRecord, WorkerReport], tuple[NewTokens, dict, dict, dict[str, int]]
        ],
    ) -> None:
        """Apply `report`'s tokens to `worker`'s sequences: as the kept step when they are
        that step again, else by `general` (the rules sequence by sequence; it returns the
        new tokens, the records grown, the logprob entries and the tokens served per
        tenant), after which what the next report needs is kept. Either refuses a bad
        report (InvalidArgument) before anything changes."""
        steady = self.match(worker, report)
        if steady is not None:
            self.apply(worker.worker_id, steady, compact(report.token_runs.token_ids, "token_ids"))
        elif report.tokens or report.token_runs.seq_ids or not _still_assigned(worker):
            worker.steady_runs = self.remember(report, *general(worker, report))
        # else no tokens at all (the late ask after a deferred report, docs/contract.md
        # "Late decisions"): nothing to apply, and the kept step stays for the next one.

    @staticmethod
    def match(worker: WorkerRecord, report: WorkerReport) -> SteadyRuns | None:
        """The worker's SteadyRuns if `report`'s tokens are that step once more: the same
        runs of one token each, each offset (if sent) at the tokens known, the same
        records assigned; else None (the report is applied sequence by sequence)."""
        steady = worker.steady_runs
        if steady is None or report.tokens:
            return None
        runs = report.token_runs
        if runs.counts or runs.seq_ids != steady.seq_ids:
            return None
        if runs.offsets and list(runs.offsets) != steady.num_known:
            return None  # a retried report, or tokens lost on the way: the general pass
        if not all(map(is_, map(worker.assigned.get, runs.seq_ids), steady.seqs)):
            return None  # by identity (records with equal fields are not the same)
        return steady

    def apply(self, worker_id: str, steady: SteadyRuns, token_ids: array) -> None:
        """Add one token to each of the kept step's sequences, in C."""
        deque(map(_APPEND, steady.outputs, token_ids), maxlen=0)
        steady.num_known = list(map(add, steady.num_known, repeat(1)))
        steady.num_steps += 1
        self._changes.grown_all(steady.grown)
        self._observer.on_tokens_reported(worker_id, steady.seq_ids, steady.ones)
        self._lifecycle.serve(steady.served)

    @staticmethod
    def remember(
        report: WorkerReport,
        new_tokens: NewTokens,
        grown: dict[int, Sequence],
        logprobs: dict,
        served: dict[str, int],
    ) -> SteadyRuns | None:
        """What the next report needs to be applied as a steady step, after `report`'s
        tokens were applied one by one: only when they were packed runs that gave each
        sequence named exactly one token (none stale, repeated, past or with logprobs);
        else None."""
        runs = report.token_runs
        seq_ids = runs.seq_ids
        num_runs = len(seq_ids)
        if (
            report.tokens
            or runs.counts
            or logprobs
            or not num_runs
            or len(new_tokens) != num_runs
            or len(grown) != num_runs
        ):
            return None
        seqs = list(map(_FIRST, new_tokens))
        outputs = list(map(_OUTPUT, seqs))
        num_known = list(map(sub, map(len, outputs), map(_AT_ADMISSION, seqs)))
        return SteadyRuns(
            seq_ids, seqs, outputs, num_known, dict(grown), [1] * num_runs, dict(served)
        )

    # ----------------------------------------------------------- decision side

    def running(self, worker: WorkerRecord, report: WorkerReport) -> Running:
        """The running part of `worker`'s decision on `report` (applied): read from the
        kept step when the report ran exactly its sequences, else from one pass over the
        running ids (which keeps what the next steady decision needs, when it can)."""
        page_size = worker.registration.page_size
        steady = self.kept_running(worker, report)
        if steady is not None:  # a steady step of the same running set: no pass
            return Running(
                steady.running_seqs,
                steady.running_ids,
                [],
                steady.page_residues[-steady.num_steps % page_size],
            )
        running, started, num_decode_pages = _running_pass(
            worker.assigned.get, report.running, page_size
        )
        running_seqs = tuple(running)
        if len(running) == len(report.running):
            running_ids = report.running
            if not started:  # every one assigned and DECODING
                _keep_running(worker, running_ids, running_seqs, page_size)
        else:
            running_ids = tuple(seq.seq_id for seq in running)
        return Running(running_seqs, running_ids, started, num_decode_pages)

    @staticmethod
    def kept_running(worker: WorkerRecord, report: WorkerReport) -> SteadyRuns | None:
        """The worker's SteadyRuns when this report's tokens were applied from it and its
        running list is the one its running part was set for; else None."""
        steady = worker.steady_runs
        if steady is None or steady.page_residues is None or report.running != steady.running_ids:
            return None
        return steady

    @staticmethod
    def forget(worker: WorkerRecord) -> None:
        """`worker` was given a sequence: its admission count starts again, so the next
        report is checked anew."""
        worker.steady_runs = None


def _still_assigned(worker: WorkerRecord) -> bool:
    """Whether `worker` keeps a step whose sequences (its runs' and its running part's)
    are all still assigned to it, by identity."""
    steady = worker.steady_runs
    if steady is None:
        return False
    assigned = worker.assigned.get
    running_ids = steady.running_ids if steady.running_ids is not None else ()
    return all(map(is_, map(assigned, steady.seq_ids), steady.seqs)) and all(
        map(is_, map(assigned, running_ids), steady.running_seqs)
    )


def _running_pass(
    assigned: Callable[[int], Sequence | None], running_ids: Iterable[int], page_size: int
) -> tuple[list[Sequence], list[Sequence], int]:
    """The running sequences' records (those still assigned), those of them not yet
    DECODING, and how many start a page at their next decode: the one pass over the
    running sequences of a decision that admits nothing, each found in one lookup."""
    decoding = _DECODING
    running: list[Sequence] = []
    started: list[Sequence] = []
    num_decode_pages = 0
    for seq_id in running_ids:
        seq = assigned(seq_id)
        if seq is None:
            continue
        running.append(seq)
        # step_budget.decode_pages, inlined: its token count - 1 starts a page.
        if not (seq.prompt_len + len(seq.output_token_ids) - 1) % page_size:
            num_decode_pages += 1
        if seq.state is not decoding:
            started.append(seq)
    return running, started, num_decode_pages


def _keep_running(
    worker: WorkerRecord,
    running_ids: Collection[int],
    running: tuple[Sequence, ...],
    page_size: int,
) -> None:
    """Set the running part of the worker's SteadyRuns when the report's running
    sequences (`running_ids`, every one assigned and DECODING) are exactly its runs'
    (the same records, the same order): the next steady step's decision then needs no
    pass over them."""
    steady = worker.steady_runs
    if (
        steady is None
        or len(running) != len(steady.seqs)
        or not all(map(is_, running, steady.seqs))
    ):
        return
    residues = [0] * page_size
    for seq in running:
        residues[(seq.prompt_len + len(seq.output_token_ids) - 1) % page_size] += 1
    steady.running_ids, steady.running_seqs = running_ids, running
    steady.page_residues, steady.num_steps = residues, 0
