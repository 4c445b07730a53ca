"""The read side of the tables: what a client or an operator is shown of a sequence,
the queue and the workers. Changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from service.core.tables.ledger import no_worker_has
from service.core.tables.sequences import Sequence
from service.core.tables.tables import Tables
from service.core.types import (
    FinishReason,
    SchedulerStatus,
    SequenceInfo,
    SequenceState,
    WorkerStatus,
)


@dataclass(frozen=True)
class OutputView:
    """Tokens of a sequence from some offset on, and whether it has finished."""

    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None
    error_message: str = ""  # why it failed, for FAILED
    # One per token of token_ids for a sequence that asked for logprobs and whose logprobs
    # are known for all of them; empty otherwise (after a restart, those of the tokens
    # restored are unknown: a view never mixes tokens with and without).
    logprobs: tuple = ()
    # For a view from token 0 of a sequence that asked: its prompt logprobs (if known).
    prompt_logprobs: tuple = ()


class Reads:
    """Views of the tables for clients and operators."""

    def __init__(self, tables: Tables, served: Callable[[str], float]) -> None:
        """`served`: a tenant's service so far, as the queue order reads it."""
        self._sequences = tables.sequences
        self._queue = tables.queue
        self._ledger = tables.ledger
        self._clock = tables.clock
        self._served = served

    def sequence_info(self, seq: Sequence) -> SequenceInfo:
        return SequenceInfo(
            seq_id=seq.seq_id,
            state=seq.state,
            worker_id=seq.worker_id or "",
            prompt_len=seq.prompt_len,
            prefilled_tokens=seq.prefilled_tokens,
            generated_tokens=max(seq.num_generated, len(seq.output_token_ids)),
            finish_reason=seq.finish_reason,
            queue_position=self.position(seq),
            error_message=seq.error_message or self._why_waiting(seq),
            cached_tokens=seq.cached_tokens,
        )

    @staticmethod
    def output(seq: Sequence, start: int) -> OutputView:
        """Generated tokens of `seq` from index `start` on."""
        if seq.output_logprobs is None:
            return OutputView(
                tuple(seq.output_token_ids[start:]),
                seq.is_finished,
                seq.finish_reason,
                seq.error_message,
            )
        return _view_with_logprobs(seq, start)

    def status(self, policy: str) -> SchedulerStatus:
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
            policy=policy,
            workers=workers,
        )

    def position(self, seq: Sequence) -> int:
        """Its place in the queue order (0: not queued)."""
        if seq.state is not SequenceState.QUEUED:
            return 0
        return self._queue.position(seq.seq_id, self._clock(), self._served)

    def servable_adapters(self, admitting_only: bool = False) -> frozenset[str]:
        """The adapters of the registered workers an operator has not drained (what is
        saved, so a restart tells the same); `admitting_only`: of those that admit now,
        not draining by their own report either."""
        return frozenset(
            a
            for w in self._ledger
            if not w.drain_requested and (w.admitting or not admitting_only)
            for a in w.registration.adapters
        )

    def num_unservable(self, servable: frozenset[str]) -> int:
        """Queued sequences whose adapter is not in `servable`."""
        return sum(
            n
            for adapter_id, n in self._queue.count_by_adapter().items()
            if adapter_id not in servable
        )

    def _why_waiting(self, seq: Sequence) -> str:
        """For a queued sequence no worker here can run (its adapter), why; else ""."""
        if seq.state is not SequenceState.QUEUED or not seq.adapter_id:
            return ""
        if seq.adapter_id in self.servable_adapters():
            return ""
        return no_worker_has(seq.adapter_id)


def _view_with_logprobs(seq: Sequence, start: int) -> OutputView:
    """Tokens from `start` up to where their logprobs' availability changes (the rest come
    in the next view), with the logprobs when they are known."""
    logprobs = seq.output_logprobs
    end = len(seq.output_token_ids)
    if start < end:
        known = logprobs[start] is not None
        end = next((i for i in range(start + 1, end) if (logprobs[i] is not None) != known), end)
    token_ids = tuple(seq.output_token_ids[start:end])
    # finished only once the view reaches the last token.
    finished = seq.is_finished and end == len(seq.output_token_ids)
    known_logprobs = tuple(logprobs[start:end]) if token_ids and logprobs[start] is not None else ()
    prompt = seq.prompt_logprobs if start == 0 and token_ids and seq.prompt_logprobs else ()
    return OutputView(
        token_ids,
        finished,
        seq.finish_reason if finished else None,
        seq.error_message if finished else "",
        known_logprobs,
        prompt,
    )
