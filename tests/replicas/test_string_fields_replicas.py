"""The string-field suite (tests/server/test_string_fields.py) against replicas over
PostgreSQL, whose text cannot hold a NUL: each bad value is refused at the edge as on
SQLite, and the replica that was sent it goes on serving (a NUL in
a worker_id or an error_message once failed every later save of that replica)."""

from __future__ import annotations

import pytest

from tests.server.test_string_fields import *  # noqa: F403 - the same tests, re-collected


@pytest.fixture
def server(start_replicas):
    """The first of two replicas on one database; the tests talk to it."""
    return start_replicas(2)[0]
