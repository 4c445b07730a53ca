"""worker_client/step_clock.py: predicting a step's time, and when to ask during it."""

from __future__ import annotations

import pytest

from worker_client.step_clock import LateAsk, RoundTrips, StepClock


def test_nothing_is_predicted_before_a_step_of_the_needed_kind_was_timed():
    clock = StepClock()
    assert clock.predict(0) is None
    clock.observe(0, 0.02)
    assert clock.predict(0) == pytest.approx(0.02)
    assert clock.predict(512) is None  # no step with prompt tokens yet


def test_prompt_tokens_cost_their_learned_share_above_the_base():
    clock = StepClock()
    clock.observe(0, 0.02)
    clock.observe(1000, 0.22)  # 0.2 s above the base: 0.2 ms a token
    assert clock.predict(500) == pytest.approx(0.12)


def test_a_few_prompt_tokens_teach_nothing():
    clock = StepClock()
    clock.observe(0, 0.02)
    clock.observe(10, 0.5)
    assert clock.predict(100) is None


def test_late_ask_leaves_three_round_trips_and_a_slack_before_the_predicted_end():
    clock, trips = StepClock(), RoundTrips()
    clock.observe(0, 0.3)
    assert LateAsk().delay(clock, trips, 0) is None  # no answer timed yet
    trips.observe(0.01)
    assert LateAsk().delay(clock, trips, 0) == pytest.approx(0.3 - 0.03 - 0.003)


def test_a_short_step_is_not_worth_a_second_report():
    clock, trips = StepClock(), RoundTrips()
    clock.observe(0, 0.025)
    trips.observe(0.005)
    assert LateAsk().delay(clock, trips, 0) is None
