"""The per-iteration worker protocol, for any engine that implements engine.api.Engine."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, replace

from lattice.scheduler.v1 import scheduler_pb2 as pb
from worker_client import convert
from worker_client.client import NotRegistered, SchedulerClient, Stopped, Superseded
from worker_client.convert import PendingReport, Work
from worker_client.engine.api import ChunkWork, Engine, FinishReason, StepOutput
from worker_client.forecast import Forecast, Holding
from worker_client.handoffs import HandoffAgent
from worker_client.resources import WorkerResources, WorkerRole
from worker_client.step_clock import LateAsk, RoundTrips, StepClock
from worker_client.step_log import StepLog

log = logging.getLogger(__name__)

# With nothing held and nothing to report, a worker asks the scheduler to hold its answer
# until work arrives (a long poll), at most this long and at most a quarter of its lease.
DEFAULT_IDLE_WAIT_SECONDS = 1.0
# SelectBatchRequest.last_step_us and answer_due_us are uint32s.
_MAX_UINT32 = 2**32 - 1


@dataclass
class LoopStats:
    """Counts a worker keeps about its own run."""

    iterations: int = 0
    registrations: int = 0
    prefill_tokens: int = 0
    decode_steps: int = 0
    generated_tokens: int = 0
    finished: int = 0
    preempted: int = 0


class WorkerLoop:
    """Register, then once per iteration: report, get a decision, evict, step the engine.

    - `stop`: leave now; what the engine holds goes back to the scheduler's queue.
    - `drain`: take nothing new, finish what is held, report it, then leave.
    A scheduler that forgot this worker (lease expired, restart) answers
    FAILED_PRECONDITION; the loop then drops everything it holds (the scheduler has
    requeued it) and registers again. After a move to another replica (the client's
    target list), the loop registers there and keeps what it holds: that replica takes
    the worker's sequences over from the shared database. A scheduler that says this
    incarnation was
    superseded (another process registered the same worker_id) ends `run` with
    `Superseded`: registering again would only take the id back and fight.

    `overlap` (the default for `run`): while the engine runs step n, the report for step
    n+1 (what the engine will hold after step n: worker_client/forecast.py) goes to the
    scheduler, and its decision is there when step n ends, so the engine never waits for
    a round trip. A sequence that ends in step n may be scheduled for step n+1; the
    engine drops it without a token. Step outputs are reported one iteration later. When
    step n is predicted to be long and the scheduler takes it, the report asks for its
    decision later (`decide_later`) and a second one, with nothing new, asks for it a few
    round trips before step n's predicted end, so that step n+1 can start a prompt that
    arrived during step n (worker_client/step_clock.py).

    With nothing held and nothing to report, the loop asks for a long poll
    (`idle_wait_seconds`) instead of polling.

    Every report carries `last_step_us`: the time of the latest step not yet reported
    (0 when none), each step's time reported once. Steps are timed on the host around
    `Engine.step`; an engine on a clock of its own (the simulator's) says how long its
    step took in `last_step_seconds`. With `overlap`, the report sent while step n runs
    carries step n-1's time, as it carries step n-1's outputs.
    """

    def __init__(
        self,
        engine: Engine,
        client: SchedulerClient,
        resources: WorkerResources,
        *,
        idle_sleep_seconds: float = 0.01,
        idle_wait_seconds: float = DEFAULT_IDLE_WAIT_SECONDS,
        overlap: bool = True,
        handoffs: HandoffAgent | None = None,
        step_log: StepLog | None = None,
        late_ask: LateAsk | None = None,
    ) -> None:
        """`idle_sleep_seconds`: the pause after a decision with nothing to run, when the
        scheduler did not hold its answer (it holds none for a worker that holds work).
        `handoffs`: this worker's ends of prefill/decode handoffs (None: it takes part in
        none, and a Handoff in a decision is ignored). `step_log`: where to write each
        decision's and step's times (worker_client/step_log.py), if anywhere. `late_ask`:
        when, in a step, to ask for the next decision (worker_client/step_clock.py)."""
        self.engine = engine
        self.client = client
        self.resources = resources
        self.overlap = overlap
        self.stats = LoopStats()
        self._idle_sleep_seconds = idle_sleep_seconds
        self._idle_wait_seconds = idle_wait_seconds
        self._lease_seconds = 0.0
        self._pending = PendingReport()
        self._moves_at_registration = 0
        self._forecast = Forecast(engine.page_size)
        self._step_us = 0  # the latest step's time, until a report carries it
        self._handoffs = handoffs
        self._decided_at = 0.0  # wall clock when the latest decision arrived
        self._step_log = step_log
        self._step_wall = (0.0, 0.0)  # wall clock when the latest step started and ended
        # Asking for a decision near the step's end, where the scheduler takes it.
        self._decides_later = False
        # Saying when an answer is due, where the scheduler may hold it until then.
        self._answers_due = False
        self._step_clock = StepClock()
        self._round_trips = RoundTrips()
        self._late_ask = late_ask if late_ask is not None else LateAsk()

    @property
    def handoffs(self) -> HandoffAgent | None:
        """This worker's ends of handoffs (None: it takes part in none)."""
        return self._handoffs

    def run(self, stop: threading.Event, drain: threading.Event | None = None) -> LoopStats:
        """Until `stop`, or the end of a `drain`. A client built with the same stop event
        ends its waits (registration and other retries included) within a second of it."""
        drain = drain or threading.Event()
        try:
            self._register()
        except Stopped:
            return self.stats  # stopped before the scheduler answered: nothing held
        try:
            if self.overlap:
                self._run_overlapped(stop, drain)
            else:
                self._run_in_turn(stop, drain)
        except Stopped:
            pass  # what is held goes back in _leave
        finally:
            self._leave()
            if self._handoffs is not None:
                self._handoffs.close()
        return self.stats

    def iterate(self, draining: bool = False) -> bool:
        """One report -> decision -> step cycle, from what the engine holds now: no sleep,
        no long poll, no overlap. False when the decision had nothing to run."""
        return self._iterate(draining, self._holding(), long_poll=False)

    # ------------------------------------------------------------------ in turn

    def _run_in_turn(self, stop: threading.Event, drain: threading.Event) -> None:
        while not stop.is_set():
            draining = drain.is_set()
            held = self._holding()
            if draining and held.is_empty and not self._pending and not self._fetching:
                return
            started = time.monotonic()
            if not self._iterate(draining, held, long_poll=True):
                self._pause_if_not_held(stop, started)

    def _iterate(self, draining: bool, held: Holding, long_poll: bool) -> bool:
        """One iteration, from `held`; False when there was nothing to run."""
        idle = long_poll and not draining and self._is_idle(held)
        work = self._exchange(self._request(draining, held, idle), held)
        if work is None:
            return True
        step = self._apply(work)
        if step is None:
            return False
        out, self._step_us = self._timed_step(step.prefill, step.decode)
        self._record(step, out)
        return True

    # ------------------------------------------------------------------ overlapped

    def _run_overlapped(self, stop: threading.Event, drain: threading.Event) -> None:
        # The engine steps on its own thread, so that this one reports meanwhile; the engine
        # is touched from here only while no step is in flight.
        with ThreadPoolExecutor(1, thread_name_prefix="engine-step") as stepper:
            work: Work | None = None  # the next step's, with something to run
            while not stop.is_set():
                draining = drain.is_set()
                if work is None:
                    work = self._decide_in_turn(stop, draining)
                    if work is None:
                        if draining and self._is_idle(self._holding()):
                            return
                        continue
                held = self._holding()
                delay = self._late_ask_delay(work, draining)
                stepping = stepper.submit(self._timed_step, work.prefill, work.decode)
                step_started = time.monotonic()
                after = self._forecast.after_step(held, work.prefill, work.decode)
                try:
                    asked_at = time.time()
                    request = self._request(draining, after, idle=False)
                    request.decide_later = delay is not None
                    if delay is None:
                        due = self._answer_due(work, draining, time.monotonic() - step_started)
                        request.answer_due_us = min(round(due * 1e6), _MAX_UINT32)
                    decision, took = self._select_timed(request)
                    # An answer due later may come later (a replica's commit waits): its
                    # round trip says nothing of how early a late ask must go.
                    measured = not request.answer_due_us
                    if delay is not None and _runs_nothing(decision):
                        # Its outputs are in, but the decision whose step runs is still the
                        # one applied; the next is asked for near the step's end, so that
                        # it can take a prompt that arrives meanwhile.
                        self._delivered(decision, deferred=True)
                        wait([stepping], timeout=max(0.0, step_started + delay - time.monotonic()))
                        asked_at = time.time()
                        draining = drain.is_set()  # a drain asked meanwhile is decided now
                        decision, took = self._select_timed(
                            self._request(draining, after, idle=False)
                        )
                    # The round trip of a decision (a deferred answer decides nothing and
                    # is quicker: the late ask's margin is in deciding round trips).
                    # (One due later still bounds it: it may lower the estimate.)
                    known = self._round_trips.seconds
                    if measured or (known is not None and took < known):
                        self._round_trips.observe(took)
                    self._decided_at = time.time()  # applied once the step ends
                    if self._handoffs is not None and decision.handoffs:
                        # A fetch touches no engine state: it need not wait for the step.
                        orders = convert.handoff_orders(decision)
                        self._handoffs.receive_early(orders, self._decided_at)
                    if decision.running_needed:
                        # Nothing of the report was applied: this step's outputs go with
                        # the previous ones in the next report, its running list in full.
                        self._pending.running_needed()
                        self._record(work, stepping.result()[0])
                        work = None
                        continue
                except NotRegistered:
                    # The step ran: its outputs are reported next if the worker keeps what
                    # it holds (it moved to another replica), dropped with it otherwise.
                    self._record(work, stepping.result()[0])
                    self._register_again(self._holding())
                    work = None
                    continue
                finally:
                    wait([stepping])  # whatever happened, the step ends before anything else
                out, step_us = stepping.result()
                self._delivered(decision)
                self._step_us = step_us  # reported with the next report, as its outputs
                self.stats.iterations += 1
                self._record(work, out)
                work = convert.work(decision, self._pending.reported_running)
                self._log_decision(asked_at, decision, work)
                work = self._apply(work)

    def _late_ask_delay(self, work: Work, draining: bool) -> float | None:
        """Seconds into `work`'s step at which to ask for the next decision, or None: ask
        now (docs/contract.md, "Late decisions"; worker_client/step_clock.py). Only where
        the scheduler defers: a worker of role both that does not drain (any other is
        decided at once, and an answer that runs nothing is then its next decision)."""
        if not self._may_ask_late(draining):
            return None
        num_prompt_tokens = sum(c.chunk_len for c in work.prefill)
        return self._late_ask.delay(self._step_clock, self._round_trips, num_prompt_tokens)

    def _may_ask_late(self, draining: bool) -> bool:
        return self._decides_later and not draining and self.resources.role is WorkerRole.BOTH

    def _answer_due(self, work: Work, draining: bool, elapsed: float) -> float:
        """Seconds from now until an overlapped report's answer is needed (docs/contract.md,
        "Answers due later"): the rest of `work`'s predicted step, `elapsed` into it, less
        the late ask's slack. 0 where the scheduler does not take it, when the step cannot
        be predicted, and while a worker that may ask late has no round trip measured
        (only answers due at once measure one)."""
        if not self._answers_due:
            return 0.0
        if self._may_ask_late(draining) and self._round_trips.seconds is None:
            return 0.0
        predicted = self._step_clock.predict(sum(c.chunk_len for c in work.prefill))
        if predicted is None:
            return 0.0
        return max(0.0, predicted - elapsed - self._late_ask.slack_seconds)

    def _select_timed(self, request: pb.SelectBatchRequest) -> tuple[pb.SchedulerDecision, float]:
        """An overlapped report's answer (never a long poll) and its round trip's seconds."""
        started = time.monotonic()
        decision = self.client.select(request)
        return decision, time.monotonic() - started

    def _decide_in_turn(self, stop: threading.Event, draining: bool) -> Work | None:
        """Report what is held now and wait for the answer (nothing in flight); the decision
        if it has a step, else None (after a pause when the scheduler did not hold it)."""
        held = self._holding()
        if draining and self._is_idle(held):
            return None
        idle = not draining and self._is_idle(held)
        started = time.monotonic()
        work = self._exchange(self._request(draining, held, idle), held)
        if work is None:
            return None
        step = self._apply(work)
        if step is None:
            self._pause_if_not_held(stop, started)
        return step

    # ------------------------------------------------------------------ shared

    @property
    def _fetching(self) -> bool:
        return self._handoffs is not None and self._handoffs.busy

    def _is_idle(self, held: Holding) -> bool:
        """Nothing held, nothing to report, no handoff being fetched."""
        return held.is_empty and not self._pending and not self._fetching

    def _holding(self) -> Holding:
        """What the engine holds now (no step in flight), after importing the handoffs
        fetched meanwhile; its cache changes since it was last asked, and the handoffs'
        outcomes, go to the next report."""
        engine = self.engine
        if self._handoffs is not None:
            for outcome in self._handoffs.finish_ready():
                self._pending.add_handoff(outcome)
        self._pending.add_cache(engine.cache_delta())
        return Holding(
            tuple(engine.waiting_ids()),
            tuple(engine.running_ids()),
            engine.kv_free_pages(),
            engine.gdn_free_slots(),
            engine.kv_cached_pages(),
        )

    def _request(self, draining: bool, held: Holding, idle: bool) -> pb.SelectBatchRequest:
        return self._pending.request(
            self.resources.worker_id,
            waiting=held.waiting,
            running=held.running,
            kv_free_pages=held.kv_free_pages,
            gdn_free_slots=held.gdn_free_slots,
            draining=draining,
            idle_wait_seconds=self._idle_wait() if idle else 0.0,
            kv_cached_pages=held.kv_cached_pages,
            last_step_us=self._step_us,
        )

    def _idle_wait(self) -> float:
        if self._lease_seconds <= 0:
            return self._idle_wait_seconds
        return min(self._idle_wait_seconds, self._lease_seconds / 4)

    def _exchange(self, request: pb.SelectBatchRequest, held: Holding) -> Work | None:
        """Report and get the decision; None when the scheduler forgot us (registered again)."""
        asked_at = time.time()
        try:
            decision = self.client.select(request)
        except NotRegistered:
            self._register_again(held)
            return None
        self._decided_at = time.time()
        if decision.running_needed:  # nothing applied: all again, the list in full
            self._pending.running_needed()
            return None
        self._delivered(decision)
        self.stats.iterations += 1
        work = convert.work(decision, self._pending.reported_running)
        self._log_decision(asked_at, decision, work)
        return work

    def _log_decision(self, asked_at: float, decision: pb.SchedulerDecision, work: Work) -> None:
        if self._step_log is not None and (work.has_step or work.drop):
            self._step_log.decision(asked_at, self._decided_at, decision.iteration, work)

    def _delivered(self, decision: pb.SchedulerDecision, deferred: bool = False) -> None:
        """The last request was answered with `decision`: its outputs and step time
        reached the scheduler (a step that ended meanwhile keeps its own time for the
        next report). `deferred`: an answer to decide_later, no step's decision."""
        self._pending.delivered(decision.iteration, deferred)
        self._step_us = 0

    def _timed_step(
        self, prefill: Sequence[ChunkWork], decode: Sequence[int]
    ) -> tuple[StepOutput, int]:
        """One engine step and its time in microseconds (at least 1: 0 means unknown)."""
        started, started_wall = time.perf_counter(), time.time()
        out = self.engine.step(prefill, decode)
        seconds = getattr(self.engine, "last_step_seconds", None)
        if seconds is None:
            seconds = time.perf_counter() - started
        self._step_wall = (started_wall, time.time())  # read after the step's result
        self._step_clock.observe(sum(c.chunk_len for c in prefill), seconds)
        return out, min(_MAX_UINT32, max(1, round(seconds * 1e6)))

    def _apply(self, work: Work) -> Work | None:
        """Evict and preempt what the decision says, note new admissions, start its
        handoffs; the step to run (without the sequences held for a peer), or None when
        there is nothing to run."""
        if work.drop:
            # Preempted ones were requeued by the scheduler already: freed, not reported.
            self.engine.evict(work.drop)
            self._pending.forget(work.drop)
            if self._handoffs is not None:
                self._handoffs.dropped(work.drop)
        for seq_id in work.admitted:
            self._pending.admitted(seq_id)
        if self._handoffs is not None:
            # A sequence held for an earlier SEND and named in decode is ours again; one
            # sent now is not decoded in the same step.
            self._handoffs.reclaim(work.decode)
            self._handoffs.start(work.handoffs, self._decided_at)
            held_back = self._handoffs.holding_back
            if held_back and any(s in held_back for s in work.decode):
                work = replace(work, decode=tuple(s for s in work.decode if s not in held_back))
            self._handoffs.decoding(work.decode)
        return work if work.has_step else None

    def _record(self, work: Work, out: StepOutput) -> None:
        """Keep a step's outputs for the next report, and count them."""
        self._pending.add(out)
        self._count(work, out)
        if self._step_log is not None:
            self._step_log.step(*self._step_wall, work, out)
        if self._handoffs is not None and (out.preempted or out.finished):
            self._handoffs.dropped([*out.preempted, *(f.seq_id for f in out.finished)])

    def _count(self, work: Work, out: StepOutput) -> None:
        _log_failures(self.resources.worker_id, out)
        self.stats.prefill_tokens += sum(c.chunk_len for c in work.prefill)
        self.stats.decode_steps += len(work.decode)
        self.stats.generated_tokens += sum(len(t) for _, t in out.tokens)
        self.stats.finished += len(out.finished)
        self.stats.preempted += len(out.preempted)

    def _pause_if_not_held(self, stop: threading.Event, started: float) -> None:
        """After a decision with nothing to run: pause, unless the scheduler held the
        answer (a long poll) for at least half of what was asked."""
        if time.monotonic() - started < self._idle_wait() / 2:
            if self._fetching:  # a fetch that ends is imported at once, not after the pause
                self._handoffs.wait_for_fetch(self._idle_sleep_seconds)
            else:
                stop.wait(self._idle_sleep_seconds)

    def _register_again(self, held: Holding) -> None:
        if self._num_moves() != self._moves_at_registration:
            # Another replica: it adopts what we hold when we register; our next report
            # carries on (tokens by offset, so nothing is applied twice).
            log.warning(
                "registering with another scheduler replica, keeping what it holds",
                extra={"worker_id": self.resources.worker_id},
            )
            self._register()
            return
        log.warning(
            "scheduler no longer knows this worker; dropping what it holds and registering again",
            extra={"worker_id": self.resources.worker_id},
        )
        held_ids = [*held.waiting, *held.running]
        self.engine.evict(held_ids)
        self._pending.reset()
        if self._handoffs is not None:
            self._handoffs.reset()
        self._register()

    def _num_moves(self) -> int:
        """How often the client moved to another replica (clients without a list: 0)."""
        return getattr(self.client, "num_moves", 0)

    def register(self) -> None:
        """Register with the scheduler; `run` does it first, a driver that calls `iterate`
        itself (the simulator) calls this before."""
        self._register()

    def _register(self) -> None:
        settings = self.client.register(self.resources)
        # The first report after a registration lists every resume point (a reset); if the
        # engine is stepping (an overlapped move), what it changes after this comes next.
        self._pending.add_cache(self.engine.cache_delta(full=True))
        self._step_us = 0  # a step before the registration is not the new one's to learn from
        self._moves_at_registration = self._num_moves()
        self.stats.registrations += 1
        self._lease_seconds = settings.lease_ttl_ms / 1000
        self._pending.packed_tokens = settings.accepts_token_runs
        self._pending.running_unchanged = settings.accepts_running_unchanged
        self._decides_later = settings.accepts_decide_later
        self._answers_due = settings.accepts_answer_due
        self._pending.registered()  # no list of ours, no decision for us yet
        log.info(
            "registered",
            extra={
                "worker_id": self.resources.worker_id,
                "chunk_size": settings.chunk_size,
                "max_batch_size": settings.max_batch_size,
                "lease_ttl_ms": settings.lease_ttl_ms,
            },
        )

    def _leave(self) -> None:
        try:
            if self._pending:
                # Deliver the last finishes and tokens; the decision is moot, we leave.
                decision = self.client.select(self._request(True, self._holding(), idle=False))
                if decision.running_needed:  # nothing was applied: once more, in full
                    self._pending.running_needed()
                    self.client.select(self._request(True, self._holding(), idle=False))
            requeued = self.client.deregister(self.resources.worker_id)
            log.info(
                "deregistered", extra={"worker_id": self.resources.worker_id, "requeued": requeued}
            )
        except Superseded:
            pass  # the id is another process's now: nothing of ours left to hand back
        except Exception as err:  # noqa: BLE001 - leaving must not mask the real error
            log.warning(
                "could not deregister cleanly: %s",
                err,
                extra={"worker_id": self.resources.worker_id},
            )


def _runs_nothing(decision: pb.SchedulerDecision) -> bool:
    """An answer with nothing to apply: the scheduler decides later (or had nothing)."""
    return not (
        decision.running_needed
        or decision.prefill
        or decision.decode
        or decision.decode_all_running
        or decision.evict
        or decision.preempt
        or decision.handoffs
    )


def _log_failures(worker_id: str, out: StepOutput) -> None:
    """Say why each sequence that failed in this step failed (the scheduler hears it too)."""
    for fin in out.finished:
        if fin.reason is FinishReason.FAILED:
            log.warning(
                "sequence failed: %s",
                fin.error_message or "no reason given",
                extra={"worker_id": worker_id, "seq_id": fin.seq_id},
            )
