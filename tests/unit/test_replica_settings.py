"""`serve --state postgresql://...`: the replica settings are checked before anything starts."""

from __future__ import annotations

import pytest

from service.core import ConfigError
from service.settings import ServeSettings


def test_a_postgresql_url_is_accepted_with_the_replica_defaults():
    settings = ServeSettings(state="postgresql://lattice@db:5432/lattice").validate()
    assert (settings.prefetch, settings.replica_lease_ms) == (8, 5000)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"state": "/var/lib/lattice"}, "state must be a PostgreSQL URL"),
        ({"state": "postgresql://h/db", "state_dir": "/tmp/x"}, "exclude each other"),
        ({"prefetch": -1}, "prefetch must not be negative"),
        ({"replica_lease_ms": 100}, "replica_lease_ms must be at least 300"),
        ({"replica_commit_wait_ms": 500}, "replica_commit_wait_ms must be within 0-100"),
        ({"replica_commit_due_wait_ms": -1}, "replica_commit_due_wait_ms must be within 0-100"),
        ({"replica_watch_ms": 0}, "replica_watch_ms must be within 1-1000"),
        ({"replica_affinity_ms": -1}, "replica_affinity_ms must not be negative"),
    ],
)
def test_bad_replica_settings_stop_the_start_with_one_line(fields, message):
    with pytest.raises(ConfigError, match=message):
        ServeSettings(**fields).validate()
