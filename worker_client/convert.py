"""Mapping between wire messages and the worker's and engine's own types (worker side).

The one place where the worker reads or builds a `lattice.scheduler.v1` message: the
registration (`register_request`), a decision (`work`: what the loop evicts and steps) and
the report (`PendingReport`: what the engine produced, with token offsets).
"""

from __future__ import annotations

from dataclasses import dataclass

from lattice.scheduler.v1 import scheduler_pb2 as pb
from worker_client.engine.api import (
    CacheDelta,
    ChunkWork,
    FinishReason,
    SequenceSpec,
    StepOutput,
    TokenLogprobs,
)
from worker_client.engine.resume_points import ResumePointLog
from worker_client.handoffs import HandoffEnd, HandoffOrder, HandoffOutcome
from worker_client.resources import WorkerResources, WorkerRole

_FINISH_REASON = {
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.MAX_LENGTH: pb.FINISH_REASON_MAX_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.FAILED: pb.FINISH_REASON_FAILED,
}
_ROLE = {
    WorkerRole.BOTH: pb.WORKER_ROLE_BOTH,
    WorkerRole.PREFILL: pb.WORKER_ROLE_PREFILL,
    WorkerRole.DECODE: pb.WORKER_ROLE_DECODE,
}
_HANDOFF_STATUS = {
    HandoffEnd.DONE: pb.HANDOFF_STATUS_DONE,
    HandoffEnd.SENDER_UNREACHABLE: pb.HANDOFF_STATUS_SENDER_UNREACHABLE,
    HandoffEnd.CHECKSUM_MISMATCH: pb.HANDOFF_STATUS_CHECKSUM_MISMATCH,
    HandoffEnd.NO_ROOM: pb.HANDOFF_STATUS_NO_ROOM,
    HandoffEnd.TIMED_OUT: pb.HANDOFF_STATUS_TIMED_OUT,
    HandoffEnd.UNKNOWN_SEQUENCE: pb.HANDOFF_STATUS_UNKNOWN_SEQUENCE,
}
_MAX_TRANSFER_US = 2**32 - 1  # HandoffResult.transfer_us is a uint32


@dataclass(frozen=True)
class Work:
    """One SchedulerDecision in the worker's terms."""

    # Ids to free before stepping: evicted (cancelled, not ours) and preempted by the
    # scheduler (already requeued there); neither is reported back.
    drop: tuple[int, ...]
    # Ids of the chunks that carry a spec: new admissions (their token count restarts).
    admitted: tuple[int, ...]
    # The engine step: prefill chunks (admissions first), then one decode per id.
    prefill: tuple[ChunkWork, ...]
    decode: tuple[int, ...]
    # Handoffs to start, as sender or receiver (before the step).
    handoffs: tuple[HandoffOrder, ...] = ()

    @property
    def has_step(self) -> bool:
        """Whether the engine has anything to run."""
        return bool(self.prefill or self.decode)


def work(decision: pb.SchedulerDecision, reported_running: tuple[int, ...] = ()) -> Work:
    """What the loop does with `decision`, the answer to a report whose running list was
    `reported_running` (what decode_all_running stands for)."""
    return Work(
        drop=(*decision.evict, *decision.preempt),
        admitted=tuple(c.seq_id for c in decision.prefill if c.HasField("spec")),
        prefill=tuple(chunk_work(c) for c in decision.prefill),
        decode=reported_running if decision.decode_all_running else tuple(decision.decode),
        handoffs=handoff_orders(decision),
    )


def handoff_orders(decision: pb.SchedulerDecision) -> tuple[HandoffOrder, ...]:
    return tuple(handoff_order(h) for h in decision.handoffs)


def handoff_order(handoff: pb.Handoff) -> HandoffOrder:
    return HandoffOrder(
        seq_id=handoff.seq_id,
        send=handoff.direction == pb.HANDOFF_DIRECTION_SEND,
        transfer_id=handoff.transfer_id,
        peer_worker_id=handoff.peer_worker_id,
        peer_address=handoff.peer_address,
        num_tokens=handoff.num_tokens,
        num_generated=handoff.num_generated,
        spec=sequence_spec(handoff.spec) if handoff.HasField("spec") else None,
        cached_tokens=handoff.cached_tokens,
        deadline_seconds=handoff.deadline_ms / 1000,
    )


def handoff_result(outcome: HandoffOutcome) -> pb.HandoffResult:
    return pb.HandoffResult(
        seq_id=outcome.seq_id,
        transfer_id=outcome.transfer_id,
        status=_HANDOFF_STATUS[outcome.end],
        num_bytes=outcome.num_bytes,
        transfer_us=min(_MAX_TRANSFER_US, round(outcome.transfer_seconds * 1e6)),
        error_message=outcome.error_message,
    )


def register_request(resources: WorkerResources) -> pb.RegisterWorkerRequest:
    return pb.RegisterWorkerRequest(
        worker_id=resources.worker_id,
        total_kv_pages=resources.total_kv_pages,
        page_size=resources.page_size,
        total_gdn_slots=resources.total_gdn_slots,
        max_batch_size=resources.max_batch_size,
        adapters=resources.adapters,
        cache_block_tokens=resources.cache_block_tokens,
        total_snapshot_slots=resources.total_snapshot_slots,
        # A worker of role BOTH says nothing of roles: today's registration, exactly.
        role=pb.WORKER_ROLE_UNSPECIFIED
        if resources.role is WorkerRole.BOTH
        else _ROLE[resources.role],
        transfer_bytes_per_second=resources.transfer_bytes_per_second,
        handoff_address=resources.handoff_address,
        max_step_tokens=resources.max_step_tokens,
        handoff_bytes_per_token=resources.handoff_bytes_per_token,
        handoff_fixed_bytes=resources.handoff_fixed_bytes,
    )


def deregister_request(worker_id: str, incarnation: int) -> pb.DeregisterWorkerRequest:
    return pb.DeregisterWorkerRequest(worker_id=worker_id, incarnation=incarnation)


def sequence_spec(s: pb.SequenceSpec) -> SequenceSpec:
    return SequenceSpec(
        prompt_token_ids=tuple(s.prompt_token_ids),
        max_new_tokens=s.max_new_tokens,
        temperature=s.sampling.temperature,
        top_p=s.sampling.top_p,
        top_k=s.sampling.top_k,
        seed=s.sampling.seed,
        stop_token_ids=tuple(s.stop_token_ids),
        adapter_id=s.adapter_id,
        logprobs=s.sampling.logprobs,
        prompt_logprobs=s.sampling.prompt_logprobs,
        ignore_eos=s.sampling.ignore_eos,
        min_new_tokens=s.sampling.min_new_tokens,
    )


def chunk_work(chunk: pb.PrefillChunk) -> ChunkWork:
    spec = sequence_spec(chunk.spec) if chunk.HasField("spec") else None
    return ChunkWork(
        chunk.seq_id,
        chunk.chunk_start,
        chunk.chunk_len,
        spec,
        cached_tokens=chunk.cached_tokens if spec is not None else 0,
    )


class PendingReport:
    """What the engine produced since the last successful SelectBatch, to report next.

    Token updates carry their offset (tokens of the sequence already delivered in this
    admission), so a report retried after a lost answer adds no token twice. Prefix-cache
    changes (`add_cache`) are kept, folded together, until delivered; a retried report
    repeats them, which changes nothing twice (adds and removes of a set). They alone do
    not make the report worth sending.
    """

    def __init__(self) -> None:
        self.finished: list[pb.FinishedSequence] = []
        self.preempted: list[int] = []
        self.tokens: dict[int, list[int]] = {}
        # seq_id -> one TokenLogprobs per entry of tokens[seq_id], for sequences that asked:
        # kept and retried with their tokens.
        self.logprobs: dict[int, list[pb.TokenLogprobs]] = {}
        # seq_id -> its prompt's logprobs, reported with its first token (and retried with it).
        self.prompt_logprobs: dict[int, list[pb.TokenLogprobs]] = {}
        self.cache_misses: list[int] = []
        # Outcomes of handoffs received, each reported once (retried with the report).
        self.handoffs: list[pb.HandoffResult] = []
        self.cache = ResumePointLog()
        # Whether the scheduler takes the packed token arrays (its registration said so:
        # RegisterWorkerResponse.accepts_token_runs); until then, TokenUpdate messages only.
        self.packed_tokens = False
        # Whether the scheduler takes running_unchanged_since and decode_all_running (its
        # registration said so: RegisterWorkerResponse.accepts_running_unchanged).
        self.running_unchanged = False
        # The running list of the latest request built, in full (what decode_all_running
        # in its answer stands for), and whether that request sent it.
        self.reported_running: tuple[int, ...] = ()
        self._sent_running = False
        # (iteration, running list) of the latest answered request that sent its running
        # list in full: a later request with the same list names the iteration instead.
        self._running_baseline: tuple[int, tuple[int, ...]] | None = None
        # seq_id -> tokens delivered to the scheduler since its admission here
        self._delivered: dict[int, int] = {}
        # The iteration of the last decision answered, which the loop applies at once (0:
        # none since the registration); each request names it (applied_iteration).
        self.applied_iteration = 0

    def __bool__(self) -> bool:
        return bool(
            self.finished or self.preempted or self.tokens or self.cache_misses or self.handoffs
        )

    def add_cache(self, delta: CacheDelta) -> None:
        """The engine's cache changes since it was last asked (a reset starts over)."""
        self.cache.apply(delta)

    def add(self, out: StepOutput) -> None:
        for seq_id, token_ids in out.tokens:
            self.tokens.setdefault(seq_id, []).extend(token_ids)
        for seq_id, logprobs in out.logprobs:
            self.logprobs.setdefault(seq_id, []).extend(_token_logprobs(lp) for lp in logprobs)
        for seq_id, logprobs in out.prompt_logprobs:
            self.prompt_logprobs[seq_id] = [_token_logprobs(lp) for lp in logprobs]
        for fin in out.finished:
            self.finished.append(
                pb.FinishedSequence(
                    seq_id=fin.seq_id,
                    reason=_FINISH_REASON[fin.reason],
                    generated_tokens=fin.generated_tokens,
                    error_message=fin.error_message,
                )
            )
        self.preempted.extend(out.preempted)
        self.cache_misses.extend(out.cache_misses)

    def admitted(self, seq_id: int) -> None:
        """A new admission (a chunk with a spec): its token count starts again."""
        self._delivered[seq_id] = 0
        self.tokens.pop(seq_id, None)
        self.logprobs.pop(seq_id, None)
        self.prompt_logprobs.pop(seq_id, None)

    def add_handoff(self, outcome: HandoffOutcome) -> None:
        """A received handoff ended; DONE: the sequence is held running here, its next
        token at offset `num_generated` (the sender reported those before)."""
        self.handoffs.append(handoff_result(outcome))
        if outcome.end is HandoffEnd.DONE:
            self.admitted(outcome.seq_id)
            self._delivered[outcome.seq_id] = outcome.num_generated

    def delivered(self, iteration: int = 0, deferred: bool = False) -> None:
        """The last request was answered (by the decision with `iteration`): all of it
        reached the scheduler. `deferred`: the answer put the decision off (decide_later),
        so the decision applied is still the one before, whose step runs."""
        if self._sent_running:
            self._running_baseline = (iteration, self.reported_running)
        if not deferred:
            self.applied_iteration = iteration
        for seq_id, token_ids in self.tokens.items():
            self._delivered[seq_id] = self._delivered.get(seq_id, 0) + len(token_ids)
        for fin in self.finished:
            self._delivered.pop(fin.seq_id, None)
        for seq_id in self.preempted:
            self._delivered.pop(seq_id, None)
        self.clear()
        self.cache.take()

    def running_needed(self) -> None:
        """The answer said the scheduler does not hold the running list the request named:
        nothing of it was applied; the next request sends everything again, the list in
        full."""
        self._running_baseline = None

    def registered(self) -> None:
        """A new registration: the scheduler holds no running list of ours and made no
        decision for this incarnation yet."""
        self._running_baseline = None
        self.applied_iteration = 0

    def forget(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self._delivered.pop(seq_id, None)

    def reset(self) -> None:
        """Nothing to report and nothing delivered: the scheduler forgot this worker (the
        cache is reported in full after the next registration: add_cache with a reset)."""
        self.clear()
        self._delivered.clear()
        self.registered()

    def clear(self) -> None:
        self.finished.clear()
        self.preempted.clear()
        self.tokens.clear()
        self.logprobs.clear()
        self.prompt_logprobs.clear()
        self.cache_misses.clear()
        self.handoffs.clear()

    def request(
        self,
        worker_id: str,
        *,
        waiting,
        running,
        kv_free_pages: int,
        gdn_free_slots: int,
        draining: bool,
        idle_wait_seconds: float = 0.0,
        kv_cached_pages: int = 0,
        last_step_us: int = 0,
        decide_later: bool = False,
    ) -> pb.SelectBatchRequest:
        """The report; `idle_wait_seconds` > 0 asks for a long poll; `last_step_us` is the
        latest step's time not yet reported (0: none); `decide_later`: the decision comes
        with the next report (docs/contract.md, "Late decisions")."""
        # The tokens in the packed form (docs/contract.md, "Packed tokens"): one array
        # each, which protobuf writes and the scheduler parses in C; a sequence with
        # logprobs goes as a TokenUpdate (the packed form has no per-token fields), and
        # so does every sequence for a scheduler that did not say it takes the arrays.
        logprobs, prompt_logprobs = self.logprobs, self.prompt_logprobs
        runs, updates = [], []
        packed = self.packed_tokens
        for s, t in self.tokens.items():
            if not packed or s in logprobs or s in prompt_logprobs:
                updates.append(
                    pb.TokenUpdate(
                        seq_id=s,
                        token_ids=t,
                        offset=self._delivered.get(s, 0),
                        logprobs=logprobs.get(s),
                        prompt_logprobs=prompt_logprobs.get(s),
                    )
                )
            elif t:
                runs.append((s, t))
        counts = [len(t) for _, t in runs]
        running = self.reported_running = tuple(running)
        baseline = self._running_baseline
        unchanged_since = (
            baseline[0]
            if self.running_unchanged and running and baseline and baseline[1] == running
            else 0
        )
        self._sent_running = not unchanged_since
        request = pb.SelectBatchRequest(
            worker_id=worker_id,
            waiting=waiting,
            running=() if unchanged_since else running,
            running_unchanged_since=unchanged_since,
            accepts_decode_all_running=self.running_unchanged,
            kv_free_pages=kv_free_pages,
            gdn_free_slots=gdn_free_slots,
            finished=self.finished,
            preempted=self.preempted,
            draining=draining,
            idle_wait_ms=int(idle_wait_seconds * 1000),
            tokens=updates,
            token_seq_ids=[s for s, _ in runs],
            token_ids=[token for _, t in runs for token in t],
            token_counts=counts if any(n != 1 for n in counts) else (),
            token_offsets=[self._delivered.get(s, 0) for s, _ in runs],
            kv_cached_pages=kv_cached_pages,
            cache_misses=self.cache_misses,
            last_step_us=last_step_us,
            handoffs=self.handoffs,
            applied_iteration=self.applied_iteration,
            decide_later=decide_later,
        )
        if self.cache:
            delta = self.cache.peek()
            request.cache.added.extend(delta.added)
            request.cache.removed.extend(delta.removed)
            request.cache.reset = delta.reset
        return request


def _token_logprobs(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(
        logprob=lp.logprob, top_token_ids=lp.top_token_ids, top_logprobs=lp.top_logprobs
    )
