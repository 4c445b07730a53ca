"""bench/harness/waits.py: a request's wait before its first step, split in three."""

from __future__ import annotations

import json

import pytest

from bench.harness.waits import steps_of, waits

T0 = 1000.0


def _decision(answered: float) -> dict:
    return {"event": "decision", "worker": "w1", "asked": answered - 0.001,
            "answered": answered, "iteration": 1, "admitted": [], "num_chunks": 0,
            "num_decodes": 1}  # fmt: skip


def _step(started: float, ended: float, chunks=()) -> dict:
    return {"event": "step", "worker": "w1", "started": started, "ended": ended,
            "chunks": [list(c) for c in chunks], "num_decodes": 1, "first_tokens": []}  # fmt: skip


def _steps(tmp_path, lines):
    path = tmp_path / "vllm-1.steps.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return steps_of(path)


def test_a_prompt_that_arrived_after_the_next_step_was_decided_waits_decided_already(
    tmp_path,
):
    steps = _steps(
        tmp_path,
        [
            _decision(T0),
            _step(T0, T0 + 0.2),  # in flight when the request arrives at T0 + 0.05
            _decision(T0 + 0.01),  # the next step's, made before the arrival
            _step(T0 + 0.2, T0 + 0.3),
            _decision(T0 + 0.21),  # made after it: takes the request
            _step(T0 + 0.3, T0 + 0.4, [(9, 0, 600, 0)]),
        ],
    )
    request = {"seq_id": 9, "sent_at": T0 + 0.05, "ttft": 0.4, "turn": 2}
    (wait,) = waits([request], steps)
    assert wait.until_next_step == pytest.approx(0.15)
    assert wait.decided_already == pytest.approx(0.1)
    assert wait.queued_on == pytest.approx(0.0)


def test_a_prompt_the_next_decisions_left_queued_waits_queued_on(tmp_path):
    steps = _steps(
        tmp_path,
        [
            _decision(T0 + 0.06),  # after the arrival, without it
            _step(T0 + 0.1, T0 + 0.2),
            _decision(T0 + 0.15),
            _step(T0 + 0.2, T0 + 0.3, [(9, 0, 600, 0)]),
        ],
    )
    request = {"seq_id": 9, "sent_at": T0 + 0.05, "ttft": 0.3, "turn": 1}
    (wait,) = waits([request], steps)
    assert (wait.until_next_step, wait.decided_already) == pytest.approx((0.05, 0.0))
    assert wait.queued_on == pytest.approx(0.1)
