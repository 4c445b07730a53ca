"""The per-iteration worker protocol, for any engine that implements engine.api.Engine."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from worker_client.client import NotRegistered, SchedulerClient, Superseded, WorkerResources
from worker_client.convert import PendingReport, chunk_work
from worker_client.engine.api import Engine, FinishReason, StepOutput

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class _Held:
    """The engine's sequences at the start of an iteration, read once."""

    waiting: list[int]
    running: list[int]


class WorkerLoop:
    """Register, then once per iteration: report, get a decision, evict, step the engine.

    - `stop`: leave now; what the engine holds goes back to the scheduler's queue.
    - `drain`: take nothing new, finish what is held, report it, then leave.
    A scheduler that forgot this worker (lease expired, restart) answers
    FAILED_PRECONDITION; the loop then drops everything it holds (the scheduler has
    requeued it) and registers again. A scheduler that says this incarnation was
    superseded (another process registered the same worker_id) ends `run` with
    `Superseded`: registering again would only take the id back and fight.
    """

    def __init__(self, engine: Engine, client: SchedulerClient, resources: WorkerResources,
                 *, idle_sleep_seconds: float = 0.01) -> None:
        self.engine = engine
        self.client = client
        self.resources = resources
        self.stats = LoopStats()
        self._idle_sleep_seconds = idle_sleep_seconds
        self._pending = PendingReport()

    def run(self, stop: threading.Event, drain: threading.Event | None = None) -> LoopStats:
        drain = drain or threading.Event()
        self._register()
        try:
            while not stop.is_set():
                draining = drain.is_set()
                held = _Held(self.engine.waiting_ids(), self.engine.running_ids())
                if draining and not held.waiting and not held.running and not self._pending:
                    break
                if not self._iterate(draining, held):
                    stop.wait(self._idle_sleep_seconds)
        finally:
            self._leave()
        return self.stats

    def iterate(self, draining: bool = False) -> bool:
        """One report -> decision -> step cycle, without sleeping (the simulator drives
        the loop this way); False when the decision had nothing to run."""
        return self._iterate(draining, _Held(self.engine.waiting_ids(), self.engine.running_ids()))

    def _iterate(self, draining: bool, held: _Held) -> bool:
        """One iteration, from what the engine holds now; False when there was nothing to run."""
        engine = self.engine
        try:
            decision = self.client.select(self._request(draining, held))
        except NotRegistered:
            log.warning("scheduler no longer knows this worker; dropping what it holds "
                        "and registering again", extra={"worker_id": self.resources.worker_id})
            held_ids = held.waiting + held.running
            engine.evict(held_ids)
            self._pending.clear()
            self._pending.forget(held_ids)
            self._register()
            return True
        self._pending.delivered()
        self.stats.iterations += 1
        # Evicted (cancelled, not ours) and preempted by the scheduler (it requeued them
        # already): freed before the step, and not reported back.
        dropped = [*decision.evict, *decision.preempt]
        if dropped:
            engine.evict(dropped)
            self._pending.forget(dropped)
        if not decision.prefill and not decision.decode:
            return False
        for chunk in decision.prefill:
            if chunk.HasField("spec"):
                self._pending.admitted(chunk.seq_id)
        out = engine.step([chunk_work(c) for c in decision.prefill], list(decision.decode))
        _log_failures(self.resources.worker_id, out)
        self._pending.add(out)
        self.stats.prefill_tokens += sum(c.chunk_len for c in decision.prefill)
        self.stats.decode_steps += len(decision.decode)
        self.stats.generated_tokens += sum(len(t) for _, t in out.tokens)
        self.stats.finished += len(out.finished)
        self.stats.preempted += len(out.preempted)
        return True

    def _request(self, draining: bool, held: _Held):
        engine = self.engine
        return self._pending.request(
            self.resources.worker_id, waiting=held.waiting,
            running=held.running, kv_free_pages=engine.num_free_kv_pages(),
            gdn_free_slots=engine.num_free_gdn_slots(), draining=draining)

    def _register(self) -> None:
        settings = self.client.register(self.resources)
        self.stats.registrations += 1
        log.info("registered", extra={"worker_id": self.resources.worker_id,
                                      "chunk_size": settings.chunk_size,
                                      "max_batch_size": settings.max_batch_size,
                                      "lease_ttl_ms": settings.lease_ttl_ms})

    def _leave(self) -> None:
        try:
            if self._pending:
                # Deliver the last finishes and tokens; the decision is moot, we leave.
                held = _Held(self.engine.waiting_ids(), self.engine.running_ids())
                self.client.select(self._request(True, held))
            requeued = self.client.deregister(self.resources.worker_id)
            log.info("deregistered", extra={"worker_id": self.resources.worker_id,
                                            "requeued": requeued})
        except Superseded:
            pass  # the id is another process's now: nothing of ours left to hand back
        except Exception as err:  # noqa: BLE001 - leaving must not mask the real error
            log.warning("could not deregister cleanly: %s", err,
                        extra={"worker_id": self.resources.worker_id})


def _log_failures(worker_id: str, out: StepOutput) -> None:
    """Say why each sequence that failed in this step failed (the scheduler hears it too)."""
    for fin in out.finished:
        if fin.reason is FinishReason.FAILED:
            log.warning("sequence failed: %s", fin.error_message or "no reason given",
                        extra={"worker_id": worker_id, "seq_id": fin.seq_id})
