"""bench.pg_commit_cost's command line: bad input refused in one line before a cluster
starts, and the smallest run of the submit shapes (a private cluster, where this machine
has PostgreSQL)."""

from __future__ import annotations

import pytest

from bench.pg_commit_cost import main
from service.state.pg_cluster import find_binaries
from tests.refusals import refusal_line


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--group", "0"], "--group takes sizes within 1-1000, comma-separated; got 0"),
        (["--group", "4,x"], "--group takes sizes within 1-1000, comma-separated; got x"),
        (["--group", "1001"], "--group takes sizes within 1-1000, comma-separated; got 1001"),
        (["--shapes", "submit,submit-groups"], "unknown shape 'submit-groups'"),
        (["--commits", "0"], "--commits must be at least 1, got 0"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(argv, message, capsys):
    assert message in refusal_line(main, argv, capsys)


@pytest.mark.slow
def test_the_submit_shapes_report_a_row_per_group_size(capsys):
    if find_binaries() is None:
        pytest.skip("no PostgreSQL binaries (initdb, pg_ctl) on this machine")
    shapes = "submit,submit-group,submit-group+sp,submit-group+guard,submit-group+1stmt"
    assert main(["--commits", "2", "--sequences", "2", "--shapes", shapes, "--group", "1,3"]) == 0
    out = capsys.readouterr().out
    submits = out.split("submits / commit")[1].splitlines()
    rows = [line.split()[:2] for line in submits[1:] if line.strip()]
    assert rows == [
        ["submit", "1"],
        ["submit-group", "1"],
        ["submit-group", "3"],
        ["submit-group+sp", "1"],
        ["submit-group+sp", "3"],
        ["submit-group+guard", "1"],
        ["submit-group+guard", "3"],
        ["submit-group+1stmt", "1"],
        ["submit-group+1stmt", "3"],
    ]
