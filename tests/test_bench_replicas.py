"""bench.replicas' command line: the configurations it takes, and bad input refused in
one line before anything starts."""

from __future__ import annotations

import pytest

from bench.replicas import _processes, main
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
