"""Command-line values are checked as they are parsed: a bad one is one line naming the
flag, exit code 2, and no call is made (the target here listens nowhere: a call would end
in "cannot reach" and exit code 1 instead)."""

from __future__ import annotations

import pytest

from service.cli import main as cli
from worker_client import cli as worker_cli

NOWHERE = ["--target", "127.0.0.1:1"]


def _refused(capsys, argv, main=cli.main) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err and "cannot reach" not in captured.err
    return captured.err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["submit", "--max-new-tokens", "-5"], "argument --max-new-tokens: must be from 1 to"),
        (["submit", "--max-new-tokens", "0"], "argument --max-new-tokens: must be from 1 to"),
        (["submit", "--max-new-tokens", "4294967296"], "must be from 1 to 4294967295"),
        (
            ["submit", "--prompt-ids", "1,2,99999999999"],
            "argument --prompt-ids: token id 99999999999 is outside 0-4294967295",
        ),
        (["submit", "--prompt-ids", "1,-2"], "token id -2 is outside"),
        (["submit", "--prompt-ids", "1,x"], "must be comma-separated integers, got 'x'"),
        (["generate", "--prompt-ids", ","], "must hold at least one token id"),
        (["submit", "--prompt-len", "0"], "argument --prompt-len: must be from 1 to"),
        (["submit", "--count", "0"], "argument --count: must be from 1 to"),
        (
            ["submit", "--temperature", "-1"],
            "argument --temperature: must be a finite number at least 0, got -1",
        ),
        (["submit", "--temperature", "nan"], "argument --temperature: must be a finite number"),
        (["submit", "--seed", "-1"], "argument --seed: must be from 0 to 18446744073709551615"),
        (["submit", "--request-id", "x" * 257], "request_id is 257 bytes; the limit is 256"),
        (["submit", "--timeout", "0"], "argument --timeout: must be a finite number above 0"),
        (["generate", "--stream-timeout", "-3"], "argument --stream-timeout: must be a finite"),
        (["status", "--", "-1"], "argument SEQ_ID: must be from 1 to 18446744073709551615, got -1"),
        (["status", "0"], "argument SEQ_ID: must be from 1 to"),
        (["cancel", "--", "-1"], "argument SEQ_ID: must be from 1 to"),
        (["cancel", "18446744073709551616"], "argument SEQ_ID: must be from 1 to"),
        (["cancel", "abc"], "argument SEQ_ID: must be an integer, got 'abc'"),
        (["drain", ""], "argument worker_id: worker_id must not be empty"),
        (["load", "--requests", "0"], "argument --requests: must be from 1 to"),
        (
            ["load", "--min-prompt-len", "10", "--max-prompt-len", "5"],
            "argument --max-prompt-len: must be at least --min-prompt-len (10), got 5",
        ),
    ],
    ids=lambda value: value if isinstance(value, str) else " ".join(value)[:40],
)
def test_a_bad_client_value_is_one_line_and_exit_2_before_any_call(capsys, argv, says):
    err = _refused(capsys, [argv[0], *NOWHERE, *argv[1:]])
    assert err.startswith(f"lattice-scheduler {argv[0]}: ")
    assert says in err, err


@pytest.mark.parametrize(
    "target, says",
    [
        ("127.0.0.1", "'127.0.0.1' has no port: expected HOST:PORT, e.g. 127.0.0.1:50051"),
        ("localhost", "'localhost' has no port: expected HOST:PORT"),
        ("127.0.0.1:", "the port must be a number from 1 to 65535, got ''"),
        ("host:99999", "the port must be a number from 1 to 65535, got '99999'"),
        ("::1", "is not an address: expected HOST:PORT ([ADDR]:PORT for IPv6)"),
    ],
)
def test_a_target_without_a_usable_port_names_the_expected_host_port(capsys, target, says):
    """Regression (outside probe): `--target 127.0.0.1` said "connection refused"."""
    err = _refused(capsys, ["status", "--target", target])
    assert err.startswith("lattice-scheduler status: argument --target: ") and says in err, err


@pytest.mark.parametrize(
    "target",
    [
        "127.0.0.1:50051",
        "[::1]:50051",
        "sched.example:443",
        "dns:///sched.example:443",
        "unix:/run/lattice.sock",
    ],
)
def test_well_formed_targets_are_accepted(target):
    from common.cli_values import target as parse_target

    assert parse_target(target) == target


def test_a_bad_target_from_the_environment_is_refused_too(capsys, monkeypatch):
    monkeypatch.setenv("LATTICE_SCHEDULER_TARGET", "10.0.0.5")
    err = _refused(capsys, ["status"])
    assert "'10.0.0.5' has no port" in err


def test_lattice_worker_requires_model(capsys):
    """Regression (outside probe): without --model it silently ran random tiny weights."""
    err = _refused(capsys, ["--worker-id", "w"], main=worker_cli.main)
    assert err.startswith("lattice-worker: the following arguments are required: --model")


def test_lattice_worker_refuses_a_scheduler_address_without_a_port(capsys):
    err = _refused(
        capsys,
        ["--worker-id", "w", "--model", "scripted", "--scheduler", "127.0.0.1"],
        main=worker_cli.main,
    )
    assert "argument --scheduler: '127.0.0.1' has no port" in err
