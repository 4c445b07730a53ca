"""The sequence table: every sequence the scheduler knows, queued, assigned or finished.

Tokens are held compactly: prompts and outputs are array('I') (4 bytes a token), so a
queued 4,000-token prompt costs about 16 KB, not a Python int per token.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from service.core.cache.prefix_cache import PromptHashes
from service.core.errors import InvalidArgument
from service.core.persist.store import SequenceProgress, StoredSequence
from service.core.types import (
    FinishReason,
    SequenceSpec,
    SequenceState,
    SubmitParams,
    TokenLogprobs,
)

# Bytes of a decision's PrefillChunk beyond its token ids: tags, lengths, seq_id,
# chunk bounds, sampling, max_new_tokens (an upper bound; see spec_wire_bytes).
_CHUNK_OVERHEAD_BYTES = 96
_MAX_VARINT32_BYTES = 5


def spec_wire_bytes(num_token_ids: int, adapter_id: str) -> int:
    """An upper bound of the bytes a first chunk whose spec carries `num_token_ids` token
    ids (prompt and stop tokens) takes in a decision: 5 bytes a uint32 varint at most."""
    return (
        _CHUNK_OVERHEAD_BYTES
        + _MAX_VARINT32_BYTES * num_token_ids
        + len(adapter_id.encode("utf-8", "surrogatepass"))
    )


def compact(token_ids: Iterable[int], field_name: str = "token ids") -> array:
    """`token_ids` as array('I'); InvalidArgument if one is outside uint32."""
    if isinstance(token_ids, array) and token_ids.typecode == "I":
        return token_ids
    try:
        return array("I", token_ids)
    except (OverflowError, TypeError):
        raise InvalidArgument(f"{field_name} must be integers within 0-{2**32 - 1}") from None


@dataclass(slots=True)
class Sequence:
    """The scheduler's record of one sequence (mutable; owned by the Scheduler)."""

    seq_id: int
    params: SubmitParams  # prompt_token_ids is an array('I')
    enqueued_at: float  # scheduler clock: when it last entered the queue
    prompt_len: int  # len(params.prompt_token_ids), read on every decision
    # Scheduler clock at its first submission (requeues keep it): the fair order's arrival.
    arrived_at: float = 0.0
    # Wall-clock seconds of its first submission: arrived_at again after a restart.
    submitted_at: float = 0.0
    state: SequenceState = SequenceState.QUEUED
    worker_id: str | None = None
    # FCFS order key while queued (ascending keys are arrival order); set by the queue.
    queue_key: int = 0
    # 1, 2, ... in the order of admissions to workers (the latest admitted is preempted first).
    admission_order: int = 0
    # Prompt tokens of the current spec handed out to the worker so far.
    cursor: int = 0
    # Prompt tokens of the current spec the worker confirmed by asking for more.
    prefilled_tokens: int = 0
    # Tokens generated so far, in order, across every assignment.
    output_token_ids: array = field(default_factory=lambda: array("I"))
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
    # For a sequence that asked for logprobs: one entry per token of output_token_ids, None
    # where unknown (tokens restored from the store after a restart: logprobs are not
    # persisted). None for a sequence that did not ask (no cost).
    output_logprobs: list[TokenLogprobs | None] | None = None
    # For a sequence that asked for prompt_logprobs: those of its prompt tokens after the
    # first, once its first token arrived (not persisted either).
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    # Prompt tokens taken from the worker's cache at its latest admission (not saved).
    cached_tokens: int = 0
    # Block hashes of its resume prompt, computed at its first cached lookup (not saved).
    prompt_hashes: PromptHashes | None = None

    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def tenant(self) -> str:
        return self.params.tenant

    @property
    def adapter_id(self) -> str:
        return self.params.adapter_id

    @property
    def is_finished(self) -> bool:
        return self.state is SequenceState.FINISHED

    def spec(self) -> SequenceSpec:
        """The spec a worker starts from: the prompt plus what was generated so far."""
        p = self.params
        done = self.output_token_ids
        sampling = p.sampling
        if done and (sampling.prompt_logprobs or sampling.min_new_tokens):
            # A resumed sequence: its prompt's logprobs came with its first token, and the
            # tokens generated so far count towards min_new_tokens.
            sampling = replace(
                sampling,
                prompt_logprobs=0,
                min_new_tokens=max(0, sampling.min_new_tokens - len(done)),
            )
        return SequenceSpec(
            prompt_token_ids=tuple(p.prompt_token_ids + done),
            max_new_tokens=p.max_new_tokens - len(done),
            adapter_id=p.adapter_id,
            sampling=sampling,
            stop_token_ids=p.stop_token_ids,
        )

    def add_tokens(
        self,
        token_ids: tuple[int, ...],
        logprobs: tuple[TokenLogprobs, ...] = (),
        prompt_logprobs: tuple[TokenLogprobs, ...] = (),
    ) -> None:
        """Append generated tokens, with their logprobs for a sequence that asked for them
        (None for each token the worker sent none for)."""
        if self.output_logprobs is not None:
            if len(logprobs) == len(token_ids):
                self.output_logprobs.extend(logprobs)
            else:
                self.output_logprobs.extend([None] * len(token_ids))
            if prompt_logprobs and not self.output_token_ids and self.prompt_logprobs is None:
                self.prompt_logprobs = tuple(prompt_logprobs)
        self.output_token_ids.extend(token_ids)

    def spec_prompt_len(self) -> int:
        """Prompt length of the current assignment's spec (tokens decoded since don't count)."""
        return self.prompt_len + self.num_generated_at_admission

    def num_tokens(self) -> int:
        """Its prompt plus every token generated so far: the tokens of its current
        assignment while running (spec prompt plus those reported since), the prompt
        length of the spec its next admission carries while queued."""
        return self.prompt_len + len(self.output_token_ids)

    def resume_token_ids(self) -> array:
        """The prompt its next spec carries: the prompt plus what was generated so far."""
        return self.params.prompt_token_ids + self.output_token_ids

    def may_use_prefix_cache(self) -> bool:
        """False for a sequence that needs every prompt position's logits
        (`prompt_logprobs`, docs/contract.md): its prompt is never taken from a cache."""
        return not self.params.sampling.prompt_logprobs

    def spec_wire_bytes(self) -> int:
        """An upper bound of the bytes its first chunk (with the spec) takes in a decision."""
        p = self.params
        return spec_wire_bytes(self.num_tokens() + len(p.stop_token_ids), p.adapter_id)

    def progress(self) -> SequenceProgress:
        return SequenceProgress(
            seq_id=self.seq_id,
            state=self.state,
            worker_id=self.worker_id,
            queue_key=self.queue_key if self.state is SequenceState.QUEUED else None,
            cursor=self.cursor,
            prefilled_tokens=self.prefilled_tokens,
            num_generated=self.num_generated,
            num_generated_at_admission=self.num_generated_at_admission,
            finish_reason=self.finish_reason,
            finish_order=self.finish_order,
            submitted_at=self.submitted_at,
            admission_order=self.admission_order,
            error_message=self.error_message,
        )


class SequenceTable:
    """Sequences by id, with request_id idempotency and bounded memory of finished ones."""

    def __init__(self, max_finished_retained: int) -> None:
        self._by_id: dict[int, Sequence] = {}
        # (principal, request_id) to seq_id: idempotency is per principal.
        self._by_request_id: dict[tuple[str, str], int] = {}
        # Finished ids, oldest first; beyond the limit the oldest are forgotten.
        self._finished: OrderedDict[int, None] = OrderedDict()
        self._max_finished_retained = max_finished_retained
        self._num_finished = 0
        self._num_admissions = 0
        self._next_seq_id = 1

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self):
        return iter(self._by_id.values())

    @property
    def next_seq_id(self) -> int:
        return self._next_seq_id

    def next_admission_order(self) -> int:
        """The number of the next admission to a worker (1, 2, ...; a restart goes on)."""
        self._num_admissions += 1
        return self._num_admissions

    def get(self, seq_id: int) -> Sequence | None:
        return self._by_id.get(seq_id)

    def by_request_id(self, principal: str, request_id: str) -> Sequence | None:
        """The sequence `principal` submitted with `request_id`, if one is known."""
        seq_id = self._by_request_id.get((principal, request_id)) if request_id else None
        return None if seq_id is None else self._by_id.get(seq_id)

    def create(self, params: SubmitParams, now: float, wall_now: float) -> Sequence:
        """Add a new QUEUED sequence with the next id (ids are never reused)."""
        params = replace(
            params,
            prompt_token_ids=compact(params.prompt_token_ids, "prompt_token_ids"),
            stop_token_ids=tuple(params.stop_token_ids),
        )
        seq = Sequence(
            seq_id=self._next_seq_id,
            params=params,
            enqueued_at=now,
            prompt_len=len(params.prompt_token_ids),
            arrived_at=now,
            submitted_at=wall_now,
            output_logprobs=_logprobs_list(params),
        )
        self._next_seq_id += 1
        self._add(seq)
        return seq

    def discard_new(self, seq: Sequence) -> None:
        """Undo `create` of a sequence the store could not save (its id stays used)."""
        del self._by_id[seq.seq_id]
        self._unindex(seq)

    def drop(self, seq_id: int) -> Sequence | None:
        """Forget a sequence this core no longer owns (not a finish: nothing is recorded)."""
        seq = self._by_id.pop(seq_id, None)
        if seq is not None:
            self._finished.pop(seq_id, None)
            self._unindex(seq)
        return seq

    def reserve_ids_below(self, next_seq_id: int) -> None:
        """Never hand out an id below `next_seq_id` (ids used before a restart)."""
        self._next_seq_id = max(self._next_seq_id, next_seq_id)

    def restore(self, stored: StoredSequence, now: float, wall_now: float) -> Sequence:
        """Add a sequence loaded from the store, as it was saved."""
        p = stored.progress
        params = replace(stored.params, prompt_token_ids=compact(stored.params.prompt_token_ids))
        seq = Sequence(
            seq_id=stored.seq_id,
            params=params,
            enqueued_at=now,
            prompt_len=len(params.prompt_token_ids),
            # The time waited before the restart still counts (aging).
            arrived_at=now - max(0.0, wall_now - p.submitted_at),
            submitted_at=p.submitted_at,
            state=p.state,
            worker_id=p.worker_id,
            queue_key=p.queue_key or 0,
            admission_order=p.admission_order,
            cursor=p.cursor,
            prefilled_tokens=p.prefilled_tokens,
            output_token_ids=compact(stored.output_token_ids),
            num_generated=p.num_generated,
            num_generated_at_admission=p.num_generated_at_admission,
            finish_reason=p.finish_reason,
            num_saved_tokens=len(stored.output_token_ids),
            finish_order=p.finish_order,
            error_message=p.error_message,
            # Logprobs are not persisted: those of the tokens restored are unknown.
            output_logprobs=(
                None
                if not params.sampling.wants_logprobs
                else [None] * len(stored.output_token_ids)
            ),
        )
        self._add(seq)
        self.reserve_ids_below(seq.seq_id + 1)
        self._num_admissions = max(self._num_admissions, seq.admission_order)
        return seq

    def restore_finished_order(self) -> None:
        """After restoring every sequence: forget-oldest order is finish order again."""
        done = sorted(
            (s for s in self._by_id.values() if s.is_finished), key=lambda s: s.finish_order
        )
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
            self._unindex(self._by_id.pop(old_id))
            forgotten.append(old_id)
        return forgotten

    def _add(self, seq: Sequence) -> None:
        self._by_id[seq.seq_id] = seq
        if seq.params.request_id:
            self._by_request_id[(seq.params.principal, seq.params.request_id)] = seq.seq_id

    def _unindex(self, seq: Sequence) -> None:
        if seq.params.request_id:
            self._by_request_id.pop((seq.params.principal, seq.params.request_id), None)


def _logprobs_list(params: SubmitParams) -> list | None:
    return [] if params.sampling.wants_logprobs else None
