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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from service.core.learn.step_model import StepShape, StepTimeModel

# Decisions awaiting their step time: at most two are in flight with overlap.
MAX_UNPAIRED = 2

ModelFactory = Callable[[], StepTimeModel]


class StepTimes:
    """The step-time model of every registered worker, and the decisions to pair."""

    def __init__(self, new_model: ModelFactory = StepTimeModel) -> None:
        self._new_model = new_model
        self._models: dict[str, StepTimeModel] = {}
        self._unpaired: dict[str, deque[StepShape]] = {}

    def registered(self, worker_id: str) -> None:
        """A new incarnation: its step times pair with its own decisions only. The model
        is kept (the same worker id is most likely the same hardware)."""
        self._unpaired[worker_id] = deque(maxlen=MAX_UNPAIRED)
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

    def measured(self, worker_id: str, step_us: int) -> tuple[StepShape, float, float] | None:
        """Pair a reported step time with the oldest unpaired decision and learn from it;
        (shape, predicted seconds, measured seconds), or None when there was nothing to
        pair (0 = unknown, or no decision with work outstanding)."""
        unpaired = self._unpaired.get(worker_id)
        if step_us <= 0 or not unpaired:
            return None
        shape = unpaired.popleft()
        measured = step_us / 1e6
        predicted = self.model(worker_id).observe(shape, measured)
        return shape, predicted, measured

    def decided(self, worker_id: str, shape: StepShape) -> None:
        """A decision with work went to the worker: its step time comes in a later report."""
        unpaired = self._unpaired.get(worker_id)
        if unpaired is None:
            unpaired = self._unpaired[worker_id] = deque(maxlen=MAX_UNPAIRED)
        unpaired.append(shape)
