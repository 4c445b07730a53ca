"""The step-time model (service/core/learn/step_model.py) and the pairing of step times with
decisions (service/core/learn/step_times.py)."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from service.core.learn.step_model import StepShape, StepTimeModel, chunk_attention
from service.core.learn.step_times import StepTimes
from tests.unit.factories import FakeClock


def _true_seconds(shape: StepShape, speed: float = 1.0) -> float:
    """A synthetic GPU: 15 ms a step, 0.07 ms a prefill token, attention, decodes."""
    ms = (
        15.0
        + 0.07 * shape.num_prefill_tokens
        + 2e-5 * shape.prefill_attention
        + 0.2 * shape.num_decodes
        + 2e-4 * shape.decode_context
    )
    return ms / 1000.0 / speed


def _random_shape(rng: random.Random) -> StepShape:
    chunks = [(rng.randrange(0, 3000), rng.randrange(1, 512)) for _ in range(rng.randrange(0, 3))]
    contexts = [rng.randrange(100, 4000) for _ in range(rng.randrange(0, 64))]
    return StepShape(
        num_prefill_tokens=sum(n for _, n in chunks),
        prefill_attention=sum(chunk_attention(s, n) for s, n in chunks),
        num_decodes=len(contexts),
        decode_context=sum(contexts),
    )


def _train(
    model: StepTimeModel, rng: random.Random, num_steps: int, speed: float = 1.0, noise: float = 0.0
) -> None:
    """`num_steps` random steps of the synthetic GPU, each time off by up to `noise`."""
    for _ in range(num_steps):
        shape = _random_shape(rng)
        factor = rng.uniform(1 - noise, 1 + noise) if noise else 1.0
        model.observe(shape, _true_seconds(shape, speed) * factor)


def _median_error(model: StepTimeModel, rng: random.Random, speed: float = 1.0) -> float:
    errors = []
    for _ in range(200):
        shape = _random_shape(rng)
        truth = _true_seconds(shape, speed)
        errors.append(abs(model.predict(shape) - truth) / truth)
    return sorted(errors)[len(errors) // 2]


def test_model_converges_on_synthetic_step_times_within_200_steps():
    rng = random.Random(1)
    model = StepTimeModel()
    assert _median_error(model, random.Random(2)) > 0.5  # the cautious default is far off
    _train(model, rng, 200, noise=0.03)
    assert _median_error(model, random.Random(2)) < 0.05
    assert model.recent_error < 0.1


def test_model_follows_a_worker_that_slows_down():
    rng = random.Random(3)
    model = StepTimeModel()
    _train(model, rng, 300)
    _train(model, rng, 300, speed=0.5)  # throttled: every step takes twice as long
    assert _median_error(model, random.Random(4), speed=0.5) < 0.05


def test_model_fitted_to_samples_predicts_them():
    rng = random.Random(5)
    samples = [(shape, _true_seconds(shape)) for shape in (_random_shape(rng) for _ in range(100))]
    model = StepTimeModel.fitted(samples)
    assert model.num_steps == 0
    assert _median_error(model, random.Random(6)) < 0.02


def test_prefill_budget_is_the_most_tokens_within_the_time():
    model = StepTimeModel.fitted(
        (s, _true_seconds(s)) for s in (_random_shape(random.Random(i)) for i in range(100))
    )
    tokens = model.prefill_budget(0.05, num_decodes=10, decode_context=10_000, prefill_context=0.0)
    at = StepShape(int(tokens), chunk_attention(0, int(tokens)), 10, 10_000)
    above = StepShape(int(tokens) + 20, chunk_attention(0, int(tokens) + 20), 10, 10_000)
    assert model.predict(at) <= 0.05 < model.predict(above)
    assert (
        model.prefill_budget(0.001, num_decodes=10, decode_context=10_000, prefill_context=0.0)
        == 0.0
    )


def test_step_times_pair_with_the_oldest_unpaired_decision():
    clock = FakeClock()
    times = StepTimes(clock=clock)
    times.registered("w0")
    first, second = StepShape(num_prefill_tokens=100), StepShape(num_decodes=4)
    assert times.measured("w0", 5000) is None  # nothing decided yet
    times.decided("w0", first)
    times.decided("w0", second)
    clock.advance_ms(6)
    assert times.measured("w0", 0) is None  # 0: unknown, pairs nothing
    step = times.measured("w0", 5000)
    assert (step.shape, step.seconds, step.refusal) == (first, 0.005, None)
    clock.advance_ms(7)
    assert times.measured("w0", 7000).shape == second
    assert times.measured("w0", 7000) is None


def test_a_registration_starts_the_pairing_afresh_and_keeps_the_model():
    clock = FakeClock()
    times = StepTimes(clock=clock)
    times.registered("w0")
    times.decided("w0", StepShape(num_prefill_tokens=100))
    clock.advance_ms(6)
    times.measured("w0", 5000)
    model = times.model("w0")
    times.decided("w0", StepShape(num_prefill_tokens=200))
    times.registered("w0")
    assert times.measured("w0", 9000) is None
    assert times.model("w0") is model and model.num_steps == 1


def _busy_worker(times: StepTimes, clock: FakeClock, real_ms: float, claim_us: int, steps: int):
    """A worker that runs `steps` steps of `real_ms` back to back (each answered when the
    previous one ends), claiming `claim_us` for each; the MeasuredSteps."""
    out = []
    shape = StepShape(num_prefill_tokens=256, num_decodes=8)
    times.decided("w0", shape)
    for _ in range(steps):
        clock.advance_ms(real_ms)
        out.append(times.measured("w0", claim_us))
        times.decided("w0", shape)
    return out


def test_a_worker_claiming_1_us_steps_that_take_20_ms_is_not_learned_and_refused_once_first():
    """Regression (outside probe): a worker reporting last_step_us = 1 for steps of
    20 ms and more made its model believe its steps were free: the budget reached its
    ceiling and every step on it took 0.84 s against a 100 ms target."""
    from service.core.vocabulary import StepTimeRefusal

    clock = FakeClock()
    times = StepTimes(clock=clock)
    times.registered("w0")
    steps = _busy_worker(times, clock, real_ms=20, claim_us=1, steps=50)
    assert times.model("w0").num_steps == 0
    assert {s.refusal for s in steps} == {StepTimeRefusal.SHORTER_THAN_CADENCE}
    assert [s.first_refusal for s in steps] == [True] + [False] * 49


def test_a_worker_claiming_uint32_max_us_is_not_learned():
    """Regression (outside probe): 4294967295 us per step starved the worker (budget 33)."""
    from service.core.vocabulary import StepTimeRefusal

    clock = FakeClock()
    times = StepTimes(clock=clock)
    times.registered("w0")
    steps = _busy_worker(times, clock, real_ms=20, claim_us=2**32 - 1, steps=10)
    assert times.model("w0").num_steps == 0
    assert {s.refusal for s in steps} == {StepTimeRefusal.LONGER_THAN_ELAPSED}


@settings(max_examples=200, deadline=None)
@given(
    real_ms=st.floats(1, 2000),
    overhead_ms=st.floats(0, 5),
    overlap=st.booleans(),
    steps=st.integers(2, 30),
)
def test_an_honest_worker_is_always_learned_and_a_lie_by_10x_never_is(
    real_ms, overhead_ms, overlap, steps
):
    """Property: a worker whose steps take real_ms, reporting once per step (overlapped,
    or after each step and a round trip of overhead_ms), has every claim learned when it
    reports the truth, and none when it reports a tenth or ten times of it (beyond the
    slack)."""
    for factor in (1.0, 0.1, 10.0):
        clock = FakeClock()
        times = StepTimes(clock=clock)
        times.registered("w0")
        claim_us = max(1, round(real_ms * factor * 1000))
        cadence_ms = real_ms if overlap else real_ms + overhead_ms
        results = _busy_worker(times, clock, cadence_ms, claim_us, steps)
        refused = [s.refusal is not None for s in results]
        if factor == 1.0:
            assert not any(refused)
            assert times.model("w0").num_steps == steps
        elif factor == 10.0 or real_ms * (1 - factor * 4) > 10 + overhead_ms:
            assert all(refused)
            assert times.model("w0").num_steps == 0


def _nonlinear_seconds(prefill: int, chunk_start: int, contexts: list[int]) -> float:
    """A GPU the five features do not fit exactly: token work flat up to 128 tokens (the
    GEMMs memory-bound), decode attention sublinear in the context."""
    ms = (
        15.0
        + 0.07 * max(0, prefill + len(contexts) - 128)
        + 2e-5 * chunk_attention(chunk_start, prefill)
        + 0.1 * len(contexts)
        + 5e-3 * math.sqrt(sum(contexts) + 1)
    )
    return ms / 1000.0


def _one_worker_steps(rng: random.Random, num_steps: int):
    """Steps as one worker on a code trace runs them: a few decodes whose context grows
    by one token a step (decodes and context move together), a 512-token chunk of a
    long prompt in 40% of the steps."""
    contexts: list[int] = []
    for _ in range(num_steps):
        start = rng.randrange(0, 6000, 512)
        prefill = 512 if rng.random() < 0.4 else 0
        if rng.random() < 0.1:
            contexts = [rng.randrange(500, 3000) for _ in range(rng.randrange(1, 9))]
        contexts = [c + 1 for c in contexts]
        shape = StepShape(
            prefill,
            chunk_attention(start, prefill) if prefill else 0.0,
            len(contexts),
            sum(contexts),
        )
        yield shape, _nonlinear_seconds(prefill, start, contexts)


def test_model_stays_accurate_over_thousands_of_steps_with_collinear_features():
    # The recursive covariance form this model had diverged here: its covariance went
    # asymmetric and indefinite after ~3,000 steps, and predictions were off 12-19,000x.
    model = StepTimeModel()
    errors = [
        abs(model.observe(shape, seconds) - seconds) / seconds
        for shape, seconds in _one_worker_steps(random.Random(0), 8000)
    ]
    assert max(errors[2000:]) < 0.1
    assert model.recent_error < 0.05


def test_a_run_of_decode_only_steps_keeps_the_prefill_weights():
    rng = random.Random(8)
    model = StepTimeModel()
    _train(model, rng, 500)
    for _ in range(3000):
        contexts = [rng.randrange(100, 4000) for _ in range(rng.randrange(1, 64))]
        shape = StepShape(num_decodes=len(contexts), decode_context=sum(contexts))
        model.observe(shape, _true_seconds(shape))
    prefill = StepShape(512, chunk_attention(1000, 512), 4, 8000)
    assert abs(model.predict(prefill) - _true_seconds(prefill)) / _true_seconds(prefill) < 0.05


def test_a_copy_learns_apart_from_its_original():
    rng = random.Random(9)
    model = StepTimeModel.fitted(
        (s, _true_seconds(s)) for s in (_random_shape(rng) for _ in range(100))
    )
    copy = model.copy()
    shape = _random_shape(rng)
    for _ in range(500):  # the table's steps are forgotten by then (0.99^500 < 1%)
        copy.observe(shape, 2 * _true_seconds(shape))
    assert abs(copy.predict(shape) - 2 * _true_seconds(shape)) < 0.05 * _true_seconds(shape)
    assert abs(model.predict(shape) - _true_seconds(shape)) < 0.02 * _true_seconds(shape)


def test_a_step_time_that_is_not_a_number_is_not_learned():
    # A NaN (a step table's cell, a broken clock) made every weight NaN for good: predict
    # then said 0 and the prefill budget had no bound.
    rng = random.Random(10)
    model = StepTimeModel()
    _train(model, rng, 300)
    for bad in (math.nan, math.inf):
        model.observe(_random_shape(rng), bad)
    assert all(math.isfinite(w) for w in model.weights)
    assert _median_error(model, random.Random(11)) < 0.05
    assert (
        model.prefill_budget(0.05, num_decodes=4, decode_context=8000, prefill_context=0) < math.inf
    )
