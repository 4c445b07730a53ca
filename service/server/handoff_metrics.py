"""The prefill/decode handoff metrics (docs/disaggregation.md), on the scheduler's
injected registry. Bounded labels: `end` takes HandoffEnd's values, `side` sender or
receiver, `worker_id` only registered workers (their series go when they leave)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from service.core.vocabulary import HandoffEnd

PREFIX = "lattice_scheduler_"
SIDES = ("sender", "receiver")


class HandoffMetrics:
    """Handoffs by how they ended, and per worker and side: handoffs, bytes, seconds."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.handoffs_started = Counter(
            PREFIX + "handoffs_started",
            "Handoffs begun: a SEND to a prefill worker, a RECEIVE booked for a decode worker.",
            registry=r,
        )
        self.handoffs = Counter(
            PREFIX + "handoffs",
            "Handoffs of a prefilled sequence from one worker to another, by how they ended.",
            ["end"],
            registry=r,
        )
        self.worker_handoffs = Counter(
            PREFIX + "worker_handoffs",
            "Handoffs done, per worker, as their sender or their receiver.",
            ["worker_id", "side"],
            registry=r,
        )
        self.worker_handoff_bytes = Counter(
            PREFIX + "worker_handoff_bytes",
            "Bytes of KV pages and GDN states moved by the worker's handoffs done.",
            ["worker_id", "side"],
            registry=r,
        )
        self.worker_handoff_seconds = Counter(
            PREFIX + "worker_handoff_seconds",
            "Seconds the worker's handoffs done took, instruction to import.",
            ["worker_id", "side"],
            registry=r,
        )
        self._per_worker = (
            self.worker_handoffs,
            self.worker_handoff_bytes,
            self.worker_handoff_seconds,
        )
        for end in HandoffEnd:  # every end shows from the start at 0
            self.handoffs.labels(end.value)

    def started(self) -> None:
        self.handoffs_started.inc()

    def ended(
        self, sender: str, receiver: str, end: HandoffEnd, num_bytes: int, seconds: float
    ) -> None:
        self.handoffs.labels(end.value).inc()
        if end is not HandoffEnd.DONE:
            return
        for worker_id, side in ((sender, "sender"), (receiver, "receiver")):
            self.worker_handoffs.labels(worker_id, side).inc()
            self.worker_handoff_bytes.labels(worker_id, side).inc(num_bytes)
            self.worker_handoff_seconds.labels(worker_id, side).inc(seconds)

    def worker_registered(self, worker_id: str) -> None:
        for metric in self._per_worker:
            for side in SIDES:
                metric.labels(worker_id, side)

    def worker_removed(self, worker_id: str) -> None:
        for metric in self._per_worker:
            for side in SIDES:
                try:
                    metric.remove(worker_id, side)
                except KeyError:
                    pass
