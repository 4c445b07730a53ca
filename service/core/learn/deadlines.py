"""When a queued request could start, from the workers' learned step times (for shedding).

With a TTFT target, a request of negative priority is sheddable: if no worker can start
it before its deadline, Submit refuses it (DeadlineUnreachable) rather than queue it to
be late. The estimate is the prefill ahead of it (queued tokens of its priority or a more
urgent one) over the fleet's prefill rate, each worker's rate being the tokens of one
step of its budget over that step's predicted time. Decodes are left out: the estimate
errs early, so a request is shed only when it is clearly too late.
"""

from __future__ import annotations

from collections.abc import Iterable

from service.core.learn.step_model import StepShape, StepTimeModel, chunk_attention


def prefill_rate(models: Iterable[tuple[StepTimeModel, int]]) -> float:
    """Prompt tokens per second the fleet prefills: (model, tokens of one step) each."""
    rate = 0.0
    for model, tokens in models:
        seconds = model.predict(StepShape(tokens, chunk_attention(0, tokens)))
        if seconds > 0:
            rate += tokens / seconds
    return rate


def start_seconds(tokens_ahead: int, rate: float) -> float | None:
    """Seconds until a request behind `tokens_ahead` prefill tokens starts; None: never
    (no worker prefills)."""
    if rate <= 0:
        return None
    return tokens_ahead / rate
