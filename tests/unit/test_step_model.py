"""The step-time model (service/core/step_model.py) and the pairing of step times with
decisions (service/core/step_times.py)."""
from __future__ import annotations

import random

from service.core.step_model import StepShape, StepTimeModel, chunk_attention
from service.core.step_times import StepTimes


def _true_seconds(shape: StepShape, speed: float = 1.0) -> float:
    """A synthetic GPU: 15 ms a step, 0.07 ms a prefill token, attention, decodes."""
    ms = (15.0 + 0.07 * shape.num_prefill_tokens + 2e-5 * shape.prefill_attention
          + 0.2 * shape.num_decodes + 2e-4 * shape.decode_context)
    return ms / 1000.0 / speed


def _random_shape(rng: random.Random) -> StepShape:
    chunks = [(rng.randrange(0, 3000), rng.randrange(1, 512)) for _ in range(rng.randrange(0, 3))]
    contexts = [rng.randrange(100, 4000) for _ in range(rng.randrange(0, 64))]
    return StepShape(num_prefill_tokens=sum(n for _, n in chunks),
                     prefill_attention=sum(chunk_attention(s, n) for s, n in chunks),
                     num_decodes=len(contexts), decode_context=sum(contexts))


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
    for _ in range(200):
        shape = _random_shape(rng)
        model.observe(shape, _true_seconds(shape) * rng.uniform(0.97, 1.03))
    assert _median_error(model, random.Random(2)) < 0.05
    assert model.recent_error < 0.1


def test_model_follows_a_worker_that_slows_down():
    rng = random.Random(3)
    model = StepTimeModel()
    for _ in range(300):
        shape = _random_shape(rng)
        model.observe(shape, _true_seconds(shape))
    for _ in range(300):  # throttled: every step takes twice as long
        shape = _random_shape(rng)
        model.observe(shape, _true_seconds(shape, speed=0.5))
    assert _median_error(model, random.Random(4), speed=0.5) < 0.05


def test_model_fitted_to_samples_predicts_them():
    rng = random.Random(5)
    samples = [(shape, _true_seconds(shape)) for shape in
               (_random_shape(rng) for _ in range(100))]
    model = StepTimeModel.fitted(samples)
    assert model.num_steps == 0
    assert _median_error(model, random.Random(6)) < 0.02


def test_prefill_budget_is_the_most_tokens_within_the_time():
    model = StepTimeModel.fitted((s, _true_seconds(s)) for s in
                                 (_random_shape(random.Random(i)) for i in range(100)))
    tokens = model.prefill_budget(0.05, num_decodes=10, decode_context=10_000,
                                  prefill_context=0.0)
    at = StepShape(int(tokens), chunk_attention(0, int(tokens)), 10, 10_000)
    above = StepShape(int(tokens) + 20, chunk_attention(0, int(tokens) + 20), 10, 10_000)
    assert model.predict(at) <= 0.05 < model.predict(above)
    assert model.prefill_budget(0.001, num_decodes=10, decode_context=10_000,
                                prefill_context=0.0) == 0.0


def test_step_times_pair_with_the_oldest_unpaired_decision():
    times = StepTimes()
    times.registered("w0")
    first, second = StepShape(num_prefill_tokens=100), StepShape(num_decodes=4)
    assert times.measured("w0", 5000) is None  # nothing decided yet
    times.decided("w0", first)
    times.decided("w0", second)
    assert times.measured("w0", 0) is None  # 0: unknown, pairs nothing
    shape, _, seconds = times.measured("w0", 5000)
    assert (shape, seconds) == (first, 0.005)
    assert times.measured("w0", 7000)[0] == second
    assert times.measured("w0", 7000) is None


def test_a_registration_starts_the_pairing_afresh_and_keeps_the_model():
    times = StepTimes()
    times.registered("w0")
    times.decided("w0", StepShape(num_prefill_tokens=100))
    times.measured("w0", 5000)
    model = times.model("w0")
    times.decided("w0", StepShape(num_prefill_tokens=200))
    times.registered("w0")
    assert times.measured("w0", 9000) is None
    assert times.model("w0") is model and model.num_steps == 1
