"""When the step in flight will end, and so when an overlapped worker asks for the next
step's decision (docs/contract.md, "Late decisions").

With the overlap a worker reports while its engine steps. Asked at the step's start, the
next decision cannot take a prompt that reaches the scheduler during the step: such a
prompt waits for the step after. Asked near the step's end, it can. `StepClock` predicts
a step's wall time from what it carries, from the steps it has timed; `RoundTrips` says how
long an answer takes; `LateAsk` puts the two together: when to ask, or None (ask now).
"""

from __future__ import annotations

from dataclasses import dataclass

# Each new measurement's weight in the moving averages.
SMOOTHING = 0.3
# Steps with fewer prompt tokens than this teach nothing about the cost of one.
MIN_PROMPT_TOKENS_TO_LEARN = 64


class StepClock:
    """Predicts a step's seconds: a base (its decode-only steps, on average) plus a cost
    per prompt token (steps with prompt tokens, their time above the base, on average).
    Nothing is predicted before it has timed a step of each kind the prediction needs."""

    def __init__(self) -> None:
        self._base_seconds: float | None = None
        self._seconds_per_prompt_token: float | None = None

    def observe(self, num_prompt_tokens: int, seconds: float) -> None:
        """One step's measured wall time, with its prompt tokens."""
        if num_prompt_tokens == 0:
            self._base_seconds = _average(self._base_seconds, seconds)
        elif num_prompt_tokens >= MIN_PROMPT_TOKENS_TO_LEARN and self._base_seconds is not None:
            per_token = max(0.0, seconds - self._base_seconds) / num_prompt_tokens
            self._seconds_per_prompt_token = _average(self._seconds_per_prompt_token, per_token)

    def predict(self, num_prompt_tokens: int) -> float | None:
        """A step's seconds, or None when it has not learned enough to say."""
        if self._base_seconds is None:
            return None
        if num_prompt_tokens == 0:
            return self._base_seconds
        if self._seconds_per_prompt_token is None:
            return None
        return self._base_seconds + self._seconds_per_prompt_token * num_prompt_tokens


class RoundTrips:
    """How long the scheduler takes to answer, on average (None before the first)."""

    def __init__(self) -> None:
        self._seconds: float | None = None

    def observe(self, seconds: float) -> None:
        self._seconds = _average(self._seconds, seconds)

    @property
    def seconds(self) -> float | None:
        return self._seconds


@dataclass(frozen=True)
class LateAsk:
    """When to ask for the next decision during a step: `margin` round trips and
    `slack_seconds` before the step's predicted end (an answer that comes after the step
    ended keeps the engine waiting), and only when that leaves at least
    `min_delay_seconds` after the step's start (a short step is not worth a second call)."""

    margin: float = 3.0
    slack_seconds: float = 0.003
    min_delay_seconds: float = 0.02

    def delay(
        self, clock: StepClock, round_trips: RoundTrips, num_prompt_tokens: int
    ) -> float | None:
        """Seconds from the step's start until the ask, or None: ask at once."""
        predicted = clock.predict(num_prompt_tokens)
        if predicted is None or round_trips.seconds is None:
            return None
        delay = predicted - self.margin * round_trips.seconds - self.slack_seconds
        return delay if delay >= self.min_delay_seconds else None


def _average(current: float | None, sample: float) -> float:
    return sample if current is None else current + SMOOTHING * (sample - current)
