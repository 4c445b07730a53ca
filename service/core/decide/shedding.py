"""Shedding at submit: whether a sheddable request could still start before its deadline.

A request with a negative priority under a TTFT target may be refused at once rather than
queued past its deadline. How long it would wait is the queue's prefill tokens of as
urgent requests ahead of it over the fleet's prefill rate, as the step-time models that
the budget spends learned it (service/core/learn/deadlines.py), so the shedder and the
budget judge every worker by the same model.
"""

from __future__ import annotations

from service.core.config import SchedulerConfig
from service.core.decide.plan import Policy
from service.core.errors import DeadlineUnreachable
from service.core.learn.deadlines import prefill_rate, start_seconds
from service.core.learn.step_times import StepTimes
from service.core.tables.tables import Tables
from service.core.types import SubmitParams


class Shedder:
    """Refuses a sheddable request that no worker could start before its deadline."""

    def __init__(
        self,
        config: SchedulerConfig,
        tables: Tables,
        policy: Policy,
        step_times: StepTimes | None,
    ) -> None:
        """`policy`: its `step_tokens(model)` is the prefill a step of that model would
        take (read only while step times are learned, by a policy with a budget)."""
        self._config = config
        self._ledger = tables.ledger
        self._queue = tables.queue
        self._policy = policy
        self._step_times = step_times

    def is_sheddable(self, params: SubmitParams) -> bool:
        """Whether `params` may be shed: a negative priority under a TTFT target."""
        return (
            bool(self._config.ttft_target_ms)
            and params.priority < 0
            and self._step_times is not None
        )

    def check(self, params: SubmitParams, tokens_elsewhere: int = 0) -> None:
        """DeadlineUnreachable for a sheddable request that no worker could start before
        its deadline, behind the queue's prefill tokens of as urgent requests plus
        `tokens_elsewhere` (another replica's share of the shared queue)."""
        if not self.is_sheddable(params):
            return
        target_ms = self._config.ttft_target_ms
        workers = [w for w in self._ledger if not (w.draining or w.drain_requested)]
        tokens_ahead = self._queue.tokens_up_to(params.priority) + tokens_elsewhere
        rate = prefill_rate(
            (model, self._policy.step_tokens(model))
            for model in map(self._step_times.model, (w.worker_id for w in workers))
        )
        wait = start_seconds(tokens_ahead, rate)
        if wait is not None and wait <= target_ms / 1000.0:
            return
        why = (
            "no worker is registered to start it"
            if not workers
            else f"{tokens_ahead} prompt tokens of as urgent requests are queued ahead of it, "
            f"about {wait:.2f} s of prefill on the {len(workers)} worker(s)"
        )
        raise DeadlineUnreachable(
            f"shed: priority {params.priority} is sheddable and cannot start before its "
            f"deadline (--ttft-target-ms {target_ms:g}): {why}; retry "
            "later or elsewhere, or submit with priority >= 0 to queue it anyway"
        )
