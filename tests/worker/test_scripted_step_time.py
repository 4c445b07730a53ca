"""ScriptedEngine's simulated step time, and the worker's --step-ms flag that sets it."""

from __future__ import annotations

import pytest

from worker_client import cli
from worker_client.engine.api import ChunkWork, SequenceSpec
from worker_client.testing import ScriptedEngine, reference_output

PROMPT = (5, 6, 7)


def _engine(step_seconds: float):
    slept: list[float] = []
    return ScriptedEngine(step_seconds=step_seconds, sleep=slept.append), slept


def test_a_step_with_work_sleeps_the_step_time_once():
    engine, slept = _engine(0.02)
    engine.step([ChunkWork(1, 0, len(PROMPT), SequenceSpec(PROMPT, 3))], [])
    engine.step([], [1])
    assert slept == [0.02, 0.02]


def test_a_step_without_work_does_not_sleep():
    engine, slept = _engine(0.02)
    engine.step([], [])
    assert slept == []


def test_no_step_time_by_default_and_the_output_does_not_depend_on_it():
    outputs = []
    for step_seconds in (0.0, 0.01):
        engine, slept = _engine(step_seconds)
        out = engine.step([ChunkWork(1, 0, len(PROMPT), SequenceSpec(PROMPT, 3))], [])
        tokens = [t for _, ts in out.tokens for t in ts]
        while engine.running_ids():
            tokens += [t for _, ts in engine.step([], [1]).tokens for t in ts]
        outputs.append(tokens)
        assert len(slept) == (3 if step_seconds else 0)
    assert outputs[0] == outputs[1] == reference_output(PROMPT, 3)


def test_a_negative_step_time_is_refused():
    with pytest.raises(ValueError, match="step_seconds"):
        ScriptedEngine(step_seconds=-0.001)


def test_step_ms_is_refused_for_a_real_model(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--worker-id", "w", "--model", "tiny", "--step-ms", "5"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--step-ms" in err and "scripted" in err and "tiny" in err


def test_a_negative_step_ms_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--worker-id", "w", "--model", "scripted", "--step-ms", "-1"])
    assert "--step-ms must not be negative" in capsys.readouterr().err


def test_step_ms_reaches_the_scripted_engine_in_seconds():
    args = cli.argparse.Namespace(
        model="scripted",
        kv_pages=None,
        page_size=16,
        gdn_slots=None,
        step_ms=12.5,
        no_prefix_cache=False,
        cache_block_tokens=None,
        snapshot_slots=None,
        prefix_cache_blocks=None,
    )
    assert cli._build_engine(args).step_seconds == 0.0125
