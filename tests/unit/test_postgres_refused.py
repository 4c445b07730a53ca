"""A PostgreSQL that refuses connections: `serve --state` ends in one line that gives the
cause (not psycopg_pool's "pool initialization incomplete after N sec"). No server needed:
nothing listens on the port."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("psycopg")

from service.cli import main as scheduler_cli
from service.core import ConfigError
from service.state.postgres import PostgresState


def _refused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"postgresql://lattice:secret@127.0.0.1:{port}/lattice"


def test_a_refused_connection_is_a_config_error_giving_the_cause():
    with pytest.raises(ConfigError) as raised:
        PostgresState(_refused_url(), name="r1", connect_timeout_seconds=2.0)
    message = str(raised.value)
    assert "refused" in message.lower(), message
    assert "pool initialization" not in message
    assert "secret" not in message  # the password stays out of the line


def test_serve_on_a_refused_database_is_one_line_with_the_cause(capsys):
    code = scheduler_cli.main(
        ["serve", "--port", "0", "--metrics-port", "0", "--state", _refused_url()]
    )
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "refused" in lines[0].lower(), lines
