"""The mechanism around a policy: one worker's decision, from view to applied plan.

`Batcher.decide` builds the read-only view of the call, asks the policy for a plan,
checks the plan (plan_check.py), and applies it: admissions leave the queue with their
first chunk and spec, prefill cursors move on, preempted sequences go back to the queue.
Which sequences and how much is the policy's; how it is carried out is here.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator

from service.core.cache.prefix_cache import longest_resume, prompt_hashes
from service.core.decide.disaggregation import Disaggregation
from service.core.decide.fleet import FleetView
from service.core.decide.plan import Chunk, DecisionView, Plan, Policy
from service.core.decide.plan_check import check_plan
from service.core.learn.step_model import StepShape, StepTimeModel, chunk_attention
from service.core.observer import RequeueReason
from service.core.tables.ledger import WorkerRecord
from service.core.tables.lifecycle import Lifecycle
from service.core.tables.sequences import Sequence
from service.core.tables.steady import SteadyStep
from service.core.tables.tables import Tables
from service.core.tables.tenants import TentativeService
from service.core.types import Decision, PrefillChunk, SequenceState, WorkerReport, WorkerRole

# Upper bounds of a decision's parts other than admissions' specs, in bytes: its fixed
# fields, one id (a uint64 varint and its share of framing), one continuation chunk.
DECISION_FIXED_BYTES = 64
_ID_BYTES = 11
_CONTINUATION_BYTES = 32
_DECODING = SequenceState.DECODING


class Batcher:
    """Turns a policy's plans into decisions, over the Scheduler's tables."""

    def __init__(
        self,
        tables: Tables,
        lifecycle: Lifecycle,
        steady: SteadyStep,
        policy: Policy,
        policy_name: str,
        max_decision_bytes: int,
        max_loras: int,
        handoffs: Disaggregation,
    ) -> None:
        """`policy_name`: config.policy, for PlanError's message; `handoffs`: the
        roles' admissions and the handoffs of each decision."""
        self._policy = policy
        self._policy_name = policy_name
        self._ledger = tables.ledger  # the fleet a worker with a prefix cache is placed in
        self._queue = tables.queue
        self._sequences = tables.sequences
        self._changes = tables.changes
        self._observer = tables.observer
        self._tenants = tables.tenants
        self._clock = tables.clock
        self._lifecycle = lifecycle
        self._steady = steady
        self._max_decision_bytes = max_decision_bytes
        self._tracks_adapters = max_loras > 0
        self._decode_context = 0  # of the latest decision made with a step model
        self._handoffs = handoffs

    def decide(
        self,
        worker: WorkerRecord,
        report: WorkerReport,
        reported: frozenset[int],
        evict: tuple[int, ...],
        step_model: StepTimeModel | None = None,
    ) -> Decision:
        """The decision for `worker`, whose report was applied (docs/contract.md rule 1)."""
        # The running sequences (the only per-sequence work of a decision that admits
        # nothing: one pass, or none in a steady step), then the waiting ones.
        role = worker.registration.role
        if role is WorkerRole.PREFILL:
            step_model = None  # it decodes nothing for long: no TPOT target to keep
        running = self._steady.running(worker, report)
        assigned = worker.assigned.get
        waiting = tuple(seq for s in report.waiting if (seq := assigned(s)) is not None)
        view = self._view(
            worker,
            report,
            reported,
            running.seqs,
            running.seq_ids,
            running.num_decode_pages,
            waiting,
            len(evict),
            step_model,
        )
        plan = self._policy.plan(view)
        limits = self._policy.budget(view)
        token_budget = limits.tokens  # before the check spends it
        check_plan(
            view,
            plan,
            limits,
            lambda seq_id: self._candidate(worker, reported, seq_id),
            self._policy_name,
        )
        if step_model is not None:
            self._decode_context = _decode_context(view, plan)
        decision = self._apply(worker, running.started, waiting, plan, evict, token_budget)
        if role is WorkerRole.BOTH:
            return decision
        free_bytes = view.decision_bytes - sum(
            self._sequences.get(c.seq_id).spec_wire_bytes() for c in decision.prefill if c.spec
        )
        return self._handoffs.decide(
            worker, decision, free_bytes, view.cached_tokens, report.applied_iteration
        )

    def shape(self, decision: Decision) -> StepShape:
        """What the step of the latest `decision` (made with a step model) holds."""
        return StepShape(
            num_prefill_tokens=sum(c.chunk_len for c in decision.prefill),
            prefill_attention=sum(
                chunk_attention(c.chunk_start, c.chunk_len) for c in decision.prefill
            ),
            num_decodes=len(decision.decode),
            decode_context=self._decode_context,
        )

    def _view(
        self,
        worker: WorkerRecord,
        report: WorkerReport,
        reported: frozenset[int],
        running: tuple[Sequence, ...],
        running_ids: Collection[int],
        num_decode_pages: int,
        waiting: tuple[Sequence, ...],
        num_evict: int,
        step_model: StepTimeModel | None,
    ) -> DecisionView:
        sequences = self._sequences
        adapters = (
            frozenset(a for seq in worker.assigned.values() if (a := seq.adapter_id))
            if self._tracks_adapters
            else frozenset()
        )
        num_ids = len(running) + len(waiting)
        decision_bytes = (
            self._max_decision_bytes
            - DECISION_FIXED_BYTES
            - _ID_BYTES * (2 * num_ids + num_evict)
            - _CONTINUATION_BYTES * len(waiting)
        )
        service = self._tenants.tentative() if self._tenants is not None else TentativeService(None)
        now = self._clock()
        cached_tokens = self._cache_lookup(worker)
        admits = self._handoffs.admits(worker, cached_tokens)  # None: any, by its role

        def queue() -> Iterator[Sequence]:
            for seq_id in self._queue.candidates(now, service.served):
                seq = sequences.get(seq_id)
                if (
                    seq_id not in reported
                    and worker.can_run(seq.adapter_id)
                    and (admits is None or admits(seq))
                ):
                    yield seq

        block_tokens = worker.resume_points.block_tokens
        return DecisionView(
            align_block_tokens=(block_tokens if worker.registration.total_snapshot_slots else 0),
            cached_tokens=cached_tokens,
            fleet=(
                FleetView(worker, self._ledger, self._ledger.fleet_cache, len(self._queue), now)
                if block_tokens
                else None
            ),
            worker_id=worker.worker_id,
            max_batch_size=worker.settings.max_batch_size,
            chunk_size=worker.settings.chunk_size,
            max_step_tokens=worker.registration.max_step_tokens,
            page_size=worker.registration.page_size,
            total_kv_pages=worker.registration.total_kv_pages,
            running=running,
            running_ids=running_ids,
            decode_pages=num_decode_pages,
            waiting=waiting,
            num_active=len(report.waiting) + len(report.running),
            kv_free_pages=report.kv_free_pages,
            # A handoff booked here takes a slot at its import (which never preempts).
            gdn_free_slots=max(
                0, report.gdn_free_slots - self._handoffs.num_incoming(worker.worker_id)
            ),
            draining=report.draining or worker.drain_requested,
            adapters_in_use=adapters,
            decision_bytes=decision_bytes,
            queue=queue,
            service=service,
            step_model=step_model,
            running_context=(
                sum(map(Sequence.num_tokens, running)) if step_model is not None else 0
            ),
        )

    @staticmethod
    def _cache_lookup(worker: WorkerRecord) -> Callable[[Sequence], int]:
        """DecisionView.cached_tokens for `worker`: each sequence's longest resume point
        there strictly below its prompt's length, looked up once per decision (its
        hashes are kept on the sequence, computed once for its prompt)."""
        resume = worker.resume_points
        block_tokens, points = resume.block_tokens, resume.points
        found: dict[int, int] = {}

        def cached_tokens(seq: Sequence) -> int:
            if not points or not seq.may_use_prefix_cache():
                return 0
            known = found.get(seq.seq_id)
            if known is None:
                num_tokens = seq.num_tokens()
                seq.prompt_hashes = prompt_hashes(
                    seq.prompt_hashes,
                    seq.resume_token_ids,
                    num_tokens,
                    seq.adapter_id,
                    block_tokens,
                )
                known = found[seq.seq_id] = longest_resume(
                    seq.prompt_hashes.hashes, num_tokens, block_tokens, points
                )
            return known

        return cached_tokens

    def _candidate(
        self, worker: WorkerRecord, reported: frozenset[int], seq_id: int
    ) -> Sequence | None:
        """The queued sequence `seq_id` if `worker` may be given it now, else None."""
        seq = self._sequences.get(seq_id)
        if (
            seq is None
            or seq_id not in self._queue
            or seq_id in reported
            or not worker.can_run(seq.adapter_id)
        ):
            return None
        return seq

    def _apply(
        self,
        worker: WorkerRecord,
        started: list[Sequence],
        waiting: tuple[Sequence, ...],
        plan: Plan,
        evict: tuple[int, ...],
        token_budget: int | None,
    ) -> Decision:
        """Carry out a checked plan; `started` are the view's running sequences not yet
        DECODING, `waiting` the view's, as the sequence table's records (written here,
        read-only to the policy)."""
        served: dict[str, int] = {}
        prefill = []
        for chunk in plan.admissions:
            seq = self._sequences.get(chunk.seq_id)
            prefill.append(self._first_chunk(worker, seq, chunk.chunk_len, chunk.cached_tokens))
            if chunk.passed is not None:
                self._observer.on_placement_passed(worker.worker_id, chunk.passed)
            tenant = seq.params.tenant
            served[tenant] = served.get(tenant, 0) + chunk.chunk_len
        for seq in started:
            if seq.seq_id not in plan.preempt:
                seq.state = _DECODING
                seq.prefilled_tokens = seq.spec_prompt_len()
                self._changes.touched(seq)
        for seq in waiting:
            # The worker asks for more, so the chunk handed out before is done.
            if seq.prefilled_tokens != seq.cursor:
                seq.prefilled_tokens = seq.cursor
                self._changes.touched(seq)
        for chunk in plan.continuations:
            seq = self._sequences.get(chunk.seq_id)
            prefill.append(self._continuation(seq, chunk))
            tenant = seq.params.tenant
            served[tenant] = served.get(tenant, 0) + chunk.chunk_len
        if plan.admissions:
            self._lifecycle.queue_changed()
        for seq_id in self._lifecycle.requeue(worker, list(plan.preempt), RequeueReason.PREEMPTED):
            self._observer.on_preempted(seq_id, worker.worker_id, plan.preempt_reason)
        if plan.blocked is not None and len(self._queue):
            self._observer.on_admission_blocked(worker.worker_id, plan.blocked)
        if served:
            self._lifecycle.serve(served)
        if prefill:
            self._observer.on_prefill_tokens(
                worker.worker_id,
                sum(c.chunk_len for c in prefill),
                sum(c.cached_tokens for c in prefill),
            )
        if plan.decode or prefill:
            self._observer.on_plan(
                worker.worker_id, len(plan.decode) + sum(c.chunk_len for c in prefill), token_budget
            )
        return Decision(tuple(prefill), plan.decode, evict, worker.iteration, plan.preempt)

    def _first_chunk(
        self, worker: WorkerRecord, seq: Sequence, chunk_len: int, cached_tokens: int
    ) -> PrefillChunk:
        spec = seq.spec()
        self._queue.remove(seq.seq_id)
        seq.admission_order = self._sequences.next_admission_order()
        seq.state = SequenceState.PREFILLING
        seq.worker_id = worker.worker_id
        seq.prefilled_tokens = 0
        seq.num_generated_at_admission = len(seq.output_token_ids)
        seq.num_generated = len(seq.output_token_ids)
        seq.cursor = cached_tokens + chunk_len
        seq.cached_tokens = cached_tokens
        worker.assigned[seq.seq_id] = seq
        self._steady.forget(worker)
        self._changes.touched(seq)
        self._observer.on_admitted(
            seq.seq_id, worker.worker_id, max(0.0, self._clock() - seq.enqueued_at)
        )
        return PrefillChunk(seq.seq_id, cached_tokens, chunk_len, spec, cached_tokens)

    def _continuation(self, seq: Sequence, chunk: Chunk) -> PrefillChunk:
        prefill = PrefillChunk(seq.seq_id, seq.cursor, chunk.chunk_len)
        seq.cursor += chunk.chunk_len
        self._changes.touched(seq)
        return prefill


def _decode_context(view: DecisionView, plan: Plan) -> int:
    """The tokens of the sequences `plan` decodes (before its decodes), from the view's
    sum over the running ones less those that do not decode."""
    if len(plan.decode) == len(view.running):
        return view.running_context
    decoding = set(plan.decode)
    return sum(seq.num_tokens() for seq in view.running if seq.seq_id in decoding)


def decides_later(worker: WorkerRecord, report: WorkerReport, evict: tuple[int, ...]) -> bool:
    """Whether a report that asks for its decision later gets it later (docs/contract.md,
    "Late decisions"): not when the worker must drop something now (evictions, a drain),
    nor for a prefill or decode worker (its handoffs are planned with each decision).
    The answer is then an empty decision, made by no policy, and the worker asks again."""
    return (
        report.decide_later
        and not evict
        and not report.draining
        and not worker.drain_requested
        and worker.registration.role is WorkerRole.BOTH
    )
