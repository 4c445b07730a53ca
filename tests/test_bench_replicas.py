"""bench.replicas' command line: the configurations it takes, and bad input refused in
one line before anything starts; with --streams, a stream that went wrong is loud."""

from __future__ import annotations

import pytest

from bench.replicas import Result, StreamEnd, _print_streams, _processes, main
from tests.refusals import refusal_line


@pytest.mark.parametrize(
    "config, processes",
    [("sqlite", 1), ("sqlite-4", 4), ("postgres-1", 1), ("postgres-16", 16)],
)
def test_a_configuration_names_its_scheduler_processes(config, processes):
    assert _processes(config) == processes


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--configs", "sqlite-0"], "unknown config 'sqlite-0'"),
        (["--configs", "postgres"], "unknown config 'postgres'"),
        (["--configs", "sqlite,pg-2"], "unknown config 'pg-2'"),
        (["--configs", "sqlite-x"], "unknown config 'sqlite-x'"),
        (["--overlap"], "--overlap needs --step-ms: a step to overlap the report with"),
        (["--step-ms", "-1"], "--step-ms must be within 0-10000, got -1"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(argv, message, capsys):
    assert message in refusal_line(main, argv, capsys)


def test_a_stream_that_went_wrong_makes_an_error_line_and_status_1(capsys):
    run = Result(
        "postgres-2",
        workers=4,
        tokens=40.0,
        streamed=38,
        streams=[
            StreamEnd(1, 0, tokens=16, finished=True),
            StreamEnd(2, 1, tokens=3, problem="ended without its last event, after 3 tokens"),
        ],
        streams_run=2,
        streams_elsewhere=1,
    )
    assert _print_streams([run]) == 1
    out, err = capsys.readouterr()
    # streams, finished, open at end, on another replica, tokens, streamed/generated, wrong
    row = ["4", "postgres-2", "2", "1", "0", "1", "of", "2", "19", "0.950", "1"]
    assert out.splitlines()[-1].split() == row
    assert "ERROR: 1 of 2 streams of 4 workers, postgres-2 went wrong" in err
    assert "seq 2 on replica 1: ended without its last event, after 3 tokens" in err

    run.streams.pop()
    assert _print_streams([run]) == 0
    assert not capsys.readouterr().err
