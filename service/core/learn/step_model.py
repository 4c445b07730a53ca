"""A worker's step time, learned online: weighted least squares over the step's shape.

A step's time is modelled as linear in five features of what it held (the scheduler's own
decision, `StepShape`): an intercept (the forward's fixed cost), prefill tokens (the
linear layers' work), prefill attention work (each chunk's tokens times the context they
attend to: previous context plus half the chunk), decodes (their linear layers' work)
and decode context (the KV the decodes read). The weights are the least-squares fit of
the measured steps, each older step weighing `forgetting` times the next one's (a worker
that drifts, from throttling or another model, is followed within about
1 / (1 - forgetting) steps), refitted with every measured step in O(5^3) operations.

The fit is kept in information form (the weighted sums of x x^T and x y, a 5 x 5 system
solved afresh each step) with stabilized forgetting: what is forgotten is replaced by
the prior's share, centred on the weights so far, so that the information about any
direction never falls below the prior's. A direction the steps do not excite (decodes and
their context moving together, a run of decode-only steps) keeps its weights instead of
drifting. The recursive (covariance) form this replaced updated the inverse in place;
over a few thousand steps with such a direction its rounding errors made the covariance
asymmetric and indefinite, and the weights diverged (predictions off by 10-1000x on a
one-worker code trace).

Plain Python floats, no numpy: a decision reads the model once (`prefill_budget`) and a
report updates it once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

# Feature scales, so that each feature of a typical step is about 1 and the fit stays
# well conditioned: kilo-tokens, mega token-contexts, hundreds of decodes, 100k contexts.
_PREFILL_SCALE = 1e-3
_ATTENTION_SCALE = 1e-6
_DECODE_SCALE = 1e-2
_CONTEXT_SCALE = 1e-5
_NUM_FEATURES = 5

# The cautious default, in milliseconds per unit of each scaled feature: 20 ms a step,
# 0.2 ms a prefill token, 0.05 ms per thousand token-contexts of attention, 0.5 ms a
# decode, 0.05 ms per thousand tokens of decode context. Slower than a mid-range GPU on
# a 7B model (the A30 profile: about 15 ms + 0.07 ms a prefill token), so that budgets
# start small and grow as steps are measured.
CAUTIOUS_WEIGHTS_MS = (20.0, 200.0, 50.0, 50.0, 5.0)
# Prior variance of each weight: wide, so that the first measured steps dominate. With
# stabilized forgetting it is also the most any weight's variance grows to while its
# feature is not excited.
_PRIOR_VARIANCE = 1e4
DEFAULT_FORGETTING = 0.99
# The error a model fitted to a table starts with: the table's own, until steps are measured.
_FITTED_ERROR = 0.1
# How fast the error estimate follows (about the last 1 / _ERROR_RATE steps).
_ERROR_RATE = 0.05


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step held, as the decision that made it says."""

    num_prefill_tokens: int = 0
    # Sum over chunks of chunk_len x (tokens before the chunk + chunk_len / 2).
    prefill_attention: float = 0.0
    num_decodes: int = 0
    # Sum over decodes of the sequence's tokens (the KV each decode reads).
    decode_context: int = 0

    def features(self) -> tuple[float, ...]:
        return (
            1.0,
            self.num_prefill_tokens * _PREFILL_SCALE,
            self.prefill_attention * _ATTENTION_SCALE,
            self.num_decodes * _DECODE_SCALE,
            self.decode_context * _CONTEXT_SCALE,
        )


def chunk_attention(chunk_start: int, chunk_len: int) -> float:
    """The attention work of one prefill chunk (StepShape.prefill_attention's term)."""
    return chunk_len * (chunk_start + chunk_len / 2)


class StepTimeModel:
    """One worker's step time in seconds, refitted with every measured step."""

    def __init__(
        self,
        weights_ms: Iterable[float] = CAUTIOUS_WEIGHTS_MS,
        *,
        forgetting: float = DEFAULT_FORGETTING,
        prior_variance: float = _PRIOR_VARIANCE,
    ) -> None:
        self.weights = [float(w) for w in weights_ms]
        assert len(self.weights) == _NUM_FEATURES and 0 < forgetting <= 1
        assert 0 < prior_variance < math.inf, prior_variance
        self.forgetting = forgetting
        self._prior_info = 1.0 / prior_variance
        # Weighted sums of x x^T and x y over the steps, the prior's share included.
        self._info = [
            [self._prior_info if i == j else 0.0 for j in range(_NUM_FEATURES)]
            for i in range(_NUM_FEATURES)
        ]
        self._moment = [self._prior_info * w for w in self.weights]
        self.num_steps = 0
        # Mean relative error |predicted - measured| / measured, recent steps weighing more.
        self.recent_error = 0.5

    @classmethod
    def fitted(
        cls, samples: Iterable[tuple[StepShape, float]], forgetting: float = DEFAULT_FORGETTING
    ) -> StepTimeModel:
        """A model fitted to (shape, seconds) samples (a step table or profile read on a
        grid), with every sample weighing the same; it goes on learning as any other."""
        model = cls(forgetting=1.0)
        for shape, seconds in samples:
            model.observe(shape, seconds)
        model.forgetting = forgetting
        model.num_steps = 0
        model.recent_error = _FITTED_ERROR
        return model

    def copy(self) -> StepTimeModel:
        """An independent model that starts where this one is (a prior for each worker)."""
        model = StepTimeModel(self.weights, forgetting=self.forgetting)
        model._prior_info = self._prior_info
        model._info = [row[:] for row in self._info]
        model._moment = self._moment[:]
        model.num_steps, model.recent_error = self.num_steps, self.recent_error
        return model

    def predict(self, shape: StepShape) -> float:
        """Predicted seconds; never below zero. The weights are used as fitted: features
        that move together (decodes and their context) may share the cost with one weight
        below zero, and zeroing it would overpredict every step that has them."""
        return max(0.0, sum([w * x for w, x in zip(self.weights, shape.features())])) / 1000.0

    def prefill_seconds(self, num_tokens: int, cached_tokens: int = 0) -> float:
        """What prefilling a prompt's tokens from `cached_tokens` to `num_tokens` adds to
        the steps that carry them: the whole prompt's prefill terms less those of its
        cached prefix. A prefix's work is part of the whole prompt's (the attention of a
        chunk from `cached_tokens` on is the whole's less the prefix's), so at weights above
        zero this is exactly the chunk's own terms, as `predict` counts them. But the two
        features move together on short prompts, and a fit can share their cost with one
        weight below zero:
        - per token below zero: at face value a chunk deep in a context (few tokens, much
          attention) would cost more than the whole prompt from its start; the whole's
          terms, less the prefix's, each floored at zero, never do;
        - per token of context below zero: at face value a long enough prompt would cost
          nothing; its attention is counted as free instead (the tokens still cost).
        So a hit never costs more than a miss nor less than nothing, a longer prompt never
        less than a shorter one, and with the context weight at or above zero a miss costs
        what `predict` adds for it, or nothing where that is below zero."""
        if cached_tokens >= num_tokens:
            return 0.0
        whole = self._prefill_terms_ms(num_tokens)
        if cached_tokens <= 0:
            return whole / 1000.0
        return max(0.0, whole - self._prefill_terms_ms(cached_tokens)) / 1000.0

    def _prefill_terms_ms(self, num_tokens: int) -> float:
        """A prompt's prefill terms from its start, in ms: never below zero, and never
        falling as the prompt grows (the attention's weight counted at zero or more)."""
        w = self.weights
        return max(
            0.0,
            w[1] * num_tokens * _PREFILL_SCALE
            + max(0.0, w[2]) * chunk_attention(0, num_tokens) * _ATTENTION_SCALE,
        )

    def observe(self, shape: StepShape, seconds: float) -> float:
        """Learn one measured step; returns the prediction it had before (seconds)."""
        predicted = self.predict(shape)
        if not math.isfinite(seconds):
            return predicted  # one bad measurement must not make every weight NaN for good
        if seconds > 0:
            error = abs(predicted - seconds) / seconds
            # The mean of the errors so far while there are few, then a moving average.
            rate = max(_ERROR_RATE, 1.0 / (self.num_steps + 1))
            self.recent_error += rate * (min(error, 10.0) - self.recent_error)
        self._update(shape.features(), seconds * 1000.0)
        self.num_steps += 1
        return predicted

    def prefill_budget(
        self, max_seconds: float, *, num_decodes: int, decode_context: int, prefill_context: float
    ) -> float:
        """The most prefill tokens P whose predicted step, with these decodes, takes at
        most `max_seconds`, counting each prefill token's attention as `prefill_context`
        + P / 2 tokens (a chunk from that context on: an upper bound for several chunks).
        0 when the decodes alone take that long; math.inf when prefill costs nothing."""
        w = self.weights
        fixed_ms = max(
            0.0, w[0] + w[3] * num_decodes * _DECODE_SCALE + w[4] * decode_context * _CONTEXT_SCALE
        )
        room_ms = max_seconds * 1000.0 - fixed_ms
        if room_ms <= 0:
            return 0.0
        # room = b P + a P^2, with a from the attention's P/2 and b per token (a prefill
        # token never counts as free or negative: then the budget is the ceiling).
        w = [max(0.0, v) for v in w]
        a = w[2] * _ATTENTION_SCALE / 2
        b = w[1] * _PREFILL_SCALE + w[2] * _ATTENTION_SCALE * prefill_context
        if a <= 0:
            return room_ms / b if b > 0 else math.inf
        return (-b + math.sqrt(b * b + 4 * a * room_ms)) / (2 * a)

    def _update(self, x: tuple[float, ...], y_ms: float) -> None:
        """Forget, add the step, refit: info = f info + (1 - f) prior + x x^T, and moment =
        f moment + (1 - f) prior w + x y with w the weights so far; the new weights solve
        info w = moment. info is symmetric positive definite (never below the prior's),
        and along a direction no step excites the weights stay as they were."""
        f = self.forgetting
        prior = (1.0 - f) * self._prior_info
        info, moment, anchor = self._info, self._moment, self.weights
        for i, xi in enumerate(x):
            row = info[i]
            for j in range(i + 1):
                row[j] = f * row[j] + xi * x[j]
            row[i] += prior
            moment[i] = f * moment[i] + xi * y_ms + prior * anchor[i]
        self.weights = _solve_lower(info, moment)


def _solve_lower(a: list[list[float]], b: list[float]) -> list[float]:
    """x with A x = b, A symmetric positive definite given by its lower triangle
    (a[i][j], j <= i), by Cholesky: A = L L^T, then two triangular solves. Plain loops:
    at five unknowns they cost less than building lists to sum."""
    n = len(b)
    low: list[list[float]] = []
    for i in range(n):
        a_i = a[i]
        row: list[float] = []
        for j in range(i):
            row_j = low[j]
            v = a_i[j]
            for k in range(j):
                v -= row[k] * row_j[k]
            row.append(v / row_j[j])
        v = a_i[i]
        for r in row:
            v -= r * r
        row.append(math.sqrt(v))
        low.append(row)
    z: list[float] = []
    for i in range(n):
        row = low[i]
        v = b[i]
        for k in range(i):
            v -= row[k] * z[k]
        z.append(v / row[i])
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        v = z[i]
        for k in range(i + 1, n):
            v -= low[k][i] * x[k]
        x[i] = v / low[i][i]
    return x
