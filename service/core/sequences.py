"""The sequence table: every sequence the scheduler knows, queued, assigned or finished."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from service.core.store import SequenceProgress, StoredSequence
from service.core.types import FinishReason, SequenceSpec, SequenceState, SubmitParams


@dataclass
class Sequence:
    """The scheduler's record of one sequence (mutable; owned by the Scheduler)."""

    seq_id: int
    params: SubmitParams
    enqueued_at: float
    state: SequenceState = SequenceState.QUEUED
    worker_id: str | None = None
    # Prompt tokens of the current spec handed out to the worker so far.
    cursor: int = 0
    # Prompt tokens of the current spec the worker confirmed by asking for more.
    prefilled_tokens: int = 0
    # Tokens generated so far, in order, across every assignment.
    output_token_ids: list[int] = field(default_factory=list)
    # Generated tokens counted from finish reports when a worker sends counts only.
    num_generated: int = 0
    # len(output_token_ids) when the current assignment started (the resume offset).
    num_generated_at_admission: int = 0
    finish_reason: FinishReason | None = None
    # How many of output_token_ids the store holds.
    num_saved_tokens: int = 0
    # 1, 2, ... in the order sequences finished (the oldest are forgotten first).
    finish_order: int = 0
    # Why it failed, as the worker said (FAILED only).
    error_message: str = ""

    @property
    def prompt_len(self) -> int:
        return len(self.params.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.state is SequenceState.FINISHED

    def spec(self) -> SequenceSpec:
        """The spec a worker starts from: the prompt plus what was generated so far."""
        p = self.params
        done = self.output_token_ids
        return SequenceSpec(
            prompt_token_ids=p.prompt_token_ids + tuple(done),
            max_new_tokens=p.max_new_tokens - len(done),
            adapter_id=p.adapter_id,
            sampling=p.sampling,
            stop_token_ids=p.stop_token_ids,
        )

    def progress(self, queue_key: int | None) -> SequenceProgress:
        return SequenceProgress(
            seq_id=self.seq_id, state=self.state, worker_id=self.worker_id,
            queue_key=queue_key, cursor=self.cursor, prefilled_tokens=self.prefilled_tokens,
            num_generated=self.num_generated,
            num_generated_at_admission=self.num_generated_at_admission,
            finish_reason=self.finish_reason, finish_order=self.finish_order,
            error_message=self.error_message,
        )

    def spec_prompt_len(self) -> int:
        """Prompt length of the current assignment's spec (tokens decoded since don't count)."""
        return self.prompt_len + self.num_generated_at_admission


class SequenceTable:
    """Sequences by id, with request_id idempotency and bounded memory of finished ones."""

    def __init__(self, max_finished_retained: int) -> None:
        self._by_id: dict[int, Sequence] = {}
        self._by_request_id: dict[str, int] = {}
        # Finished ids, oldest first; beyond the limit the oldest are forgotten.
        self._finished: OrderedDict[int, None] = OrderedDict()
        self._max_finished_retained = max_finished_retained
        self._num_finished = 0
        self._next_seq_id = 1

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self):
        return iter(self._by_id.values())

    @property
    def next_seq_id(self) -> int:
        return self._next_seq_id

    def get(self, seq_id: int) -> Sequence | None:
        return self._by_id.get(seq_id)

    def by_request_id(self, request_id: str) -> Sequence | None:
        seq_id = self._by_request_id.get(request_id) if request_id else None
        return None if seq_id is None else self._by_id.get(seq_id)

    def create(self, params: SubmitParams, now: float) -> Sequence:
        """Add a new QUEUED sequence with the next id (ids are never reused)."""
        seq = Sequence(seq_id=self._next_seq_id, params=params, enqueued_at=now)
        self._next_seq_id += 1
        self._add(seq)
        return seq

    def discard_new(self, seq: Sequence) -> None:
        """Undo `create` of a sequence the store could not save (its id stays used)."""
        del self._by_id[seq.seq_id]
        if seq.params.request_id:
            self._by_request_id.pop(seq.params.request_id, None)

    def reserve_ids_below(self, next_seq_id: int) -> None:
        """Never hand out an id below `next_seq_id` (ids used before a restart)."""
        self._next_seq_id = max(self._next_seq_id, next_seq_id)

    def restore(self, stored: StoredSequence, now: float) -> Sequence:
        """Add a sequence loaded from the store, as it was saved."""
        p = stored.progress
        seq = Sequence(
            seq_id=stored.seq_id, params=stored.params, enqueued_at=now, state=p.state,
            worker_id=p.worker_id, cursor=p.cursor, prefilled_tokens=p.prefilled_tokens,
            output_token_ids=list(stored.output_token_ids), num_generated=p.num_generated,
            num_generated_at_admission=p.num_generated_at_admission,
            finish_reason=p.finish_reason, num_saved_tokens=len(stored.output_token_ids),
            finish_order=p.finish_order, error_message=p.error_message,
        )
        self._add(seq)
        self.reserve_ids_below(seq.seq_id + 1)
        return seq

    def restore_finished_order(self) -> None:
        """After restoring every sequence: forget-oldest order is finish order again."""
        done = sorted((s for s in self._by_id.values() if s.is_finished),
                      key=lambda s: s.finish_order)
        self._finished = OrderedDict((s.seq_id, None) for s in done)
        self._num_finished = max((s.finish_order for s in done), default=0)

    def mark_finished(self, seq: Sequence, reason: FinishReason) -> list[int]:
        """Finish `seq`; forget the oldest finished sequences beyond the limit and
        return their ids."""
        seq.state = SequenceState.FINISHED
        seq.finish_reason = reason
        seq.worker_id = None
        self._num_finished += 1
        seq.finish_order = self._num_finished
        self._finished[seq.seq_id] = None
        forgotten = []
        while len(self._finished) > self._max_finished_retained:
            old_id, _ = self._finished.popitem(last=False)
            old = self._by_id.pop(old_id)
            if old.params.request_id:
                self._by_request_id.pop(old.params.request_id, None)
            forgotten.append(old_id)
        return forgotten

    def _add(self, seq: Sequence) -> None:
        self._by_id[seq.seq_id] = seq
        if seq.params.request_id:
            self._by_request_id[seq.params.request_id] = seq.seq_id
