"""Each worker's step times, paired with the decisions whose steps they timed.

A worker reports its last step's time (`WorkerReport.last_step_us`), each step once, in
the order its steps ran, and it runs every decision that had work, in order. So each
reported time belongs to the oldest decision with work not yet paired: a FIFO per
worker. With overlapped iterations the report sent while step n runs carries step n-1's
time (two decisions are then unpaired: n-1, paired now, and n); in turn, the report
after step n carries n's. A registration starts the FIFO afresh (what ran before it is
not the new incarnation's), and a FIFO never holds more than `MAX_UNPAIRED` decisions
(a worker that reports no times cannot make it grow). A decision whose answer was lost
on the way shifts the pairing by one step until the worker registers again: neighbouring
steps are alike, and the model's error (a metric) would show it.

A reported time is a claim, checked against what the scheduler saw before it is learned:
no longer than the time since its decision was answered, and not far shorter than the
span since the worker's last answer while it had a step to run (its cadence). A claim
that contradicts either is not learned (`MeasuredStep.refusal`), so a worker that
reports 1 us steps cannot make its budget, nor the shedder's estimate, believe its steps
are free, and one that reports 4294967295 us cannot starve itself; a claim with no busy
span to check it against (the first after an idle spell) is not learned either.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from service.core.learn.step_model import StepShape, StepTimeModel
from service.core.vocabulary import StepTimeRefusal

# Decisions awaiting their step time: at most two are in flight with overlap.
MAX_UNPAIRED = 2

# What the scheduler sees bounds what a worker may claim (docs/contract.md, "Step
# times"). A step ran after its decision was answered and before the report that times
# it arrived, so it took at most that long (with room for the two clocks' rates). And a
# worker that was busy between its last answer and this report reports about once per
# step: with overlap the span is about the step the report times, without it that step
# plus a round trip. A claim this many times shorter than the span, and shorter by more
# than the slack, contradicts the worker's cadence.
ELAPSED_RATIO = 1.1
ELAPSED_SLACK_SECONDS = 0.002
CADENCE_RATIO = 4.0
CADENCE_SLACK_SECONDS = 0.010

ModelFactory = Callable[[], StepTimeModel]


@dataclass(frozen=True, slots=True)
class MeasuredStep:
    """A reported step time paired with the decision it timed."""

    shape: StepShape
    predicted_seconds: float  # the model's prediction before this step
    seconds: float  # as reported
    # Why it was refused (None: not contradicted, and learned when a busy span let it be
    # checked); `bound_seconds`: the elapsed time or the cadence it broke.
    refusal: StepTimeRefusal | None = None
    bound_seconds: float = 0.0
    first_refusal: bool = False  # the first refusal of this worker's claims


@dataclass(slots=True)
class _Pending:
    """A worker's decisions awaiting their step time, with when each was answered."""

    decisions: deque[tuple[StepShape, float]]
    # When its latest decision was answered, if it then had a step to run or running
    # (None: it may have been idle since, so the span says nothing of its steps).
    busy_since: float | None = None


class StepTimes:
    """The step-time model of every registered worker, and the decisions to pair."""

    def __init__(
        self, new_model: ModelFactory = StepTimeModel, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._new_model = new_model
        self._clock = clock
        self._models: dict[str, StepTimeModel] = {}
        self._pending: dict[str, _Pending] = {}
        self._refused: set[str] = set()  # workers whose claims were refused at least once

    def registered(self, worker_id: str) -> None:
        """A new incarnation: its step times pair with its own decisions only. The model
        is kept (the same worker id is most likely the same hardware)."""
        self._pending[worker_id] = _Pending(deque(maxlen=MAX_UNPAIRED))
        if worker_id not in self._models:
            self._models[worker_id] = self._new_model()

    def model(self, worker_id: str) -> StepTimeModel:
        """The worker's model (a new one for a worker not seen registering: recovered
        after a restart, or adopted from another replica). Models outlive their worker's
        registration: a worker id names the same hardware when it comes back."""
        model = self._models.get(worker_id)
        if model is None:
            model = self._models[worker_id] = self._new_model()
        return model

    def measured(self, worker_id: str, step_us: int) -> MeasuredStep | None:
        """Pair a reported step time with the oldest unpaired decision and learn from it
        when what the scheduler saw of the worker allows it; None when there was nothing
        to pair (0 = unknown, or no decision with work outstanding)."""
        pending = self._pending.get(worker_id)
        if step_us <= 0 or pending is None or not pending.decisions:
            return None
        shape, answered_at = pending.decisions.popleft()
        seconds = step_us / 1e6
        now = self._clock()
        model = self.model(worker_id)
        elapsed = now - answered_at
        if seconds > elapsed * ELAPSED_RATIO + ELAPSED_SLACK_SECONDS:
            refusal = StepTimeRefusal.LONGER_THAN_ELAPSED
            return self._refuse(worker_id, shape, model, seconds, refusal, elapsed)
        if pending.busy_since is None:
            # Nothing to check a short claim against (the worker may have idled since
            # its last answer): not learned either way, so that one lie cannot stand.
            return MeasuredStep(shape, model.predict(shape), seconds)
        span = now - pending.busy_since
        if seconds * CADENCE_RATIO + CADENCE_SLACK_SECONDS < span:
            refusal = StepTimeRefusal.SHORTER_THAN_CADENCE
            return self._refuse(worker_id, shape, model, seconds, refusal, span)
        return MeasuredStep(shape, model.observe(shape, seconds), seconds)

    def decided(self, worker_id: str, shape: StepShape | None) -> None:
        """A decision went to the worker: `shape` (None: it had no work) is timed by a
        later report."""
        pending = self._pending.get(worker_id)
        if pending is None:
            pending = self._pending[worker_id] = _Pending(deque(maxlen=MAX_UNPAIRED))
        now = self._clock()
        if shape is not None:
            pending.decisions.append((shape, now))
        pending.busy_since = now if pending.decisions else None

    def _refuse(
        self,
        worker_id: str,
        shape: StepShape,
        model: StepTimeModel,
        seconds: float,
        refusal: StepTimeRefusal,
        bound: float,
    ) -> MeasuredStep:
        """Not learned: the claim contradicts `bound`, what the scheduler saw."""
        first = worker_id not in self._refused
        self._refused.add(worker_id)
        return MeasuredStep(shape, model.predict(shape), seconds, refusal, bound, first)
