"""A private PostgreSQL cluster for the replica tests, and a fresh database per test.

The cluster is started once per session (initdb and pg_ctl under a temporary directory,
on a free loopback port; as root, as the `postgres` user). Every test that asks for
`database_url` gets a database of its own. Tests skip, saying why, only where this
machine has no PostgreSQL binaries.
"""
from __future__ import annotations

import itertools
import tempfile
from collections.abc import Iterator

import pytest

from service.pg_cluster import DATABASE, ROLE, PrivateCluster, find_binaries

_names = itertools.count(1)


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PrivateCluster]:
    if find_binaries() is None:
        pytest.skip("no PostgreSQL binaries (initdb, pg_ctl) on this machine: install "
                    "postgresql (scripts/test.sh does as root) to run the replica tests")
    directory = tempfile.mkdtemp(prefix="lattice-pg-")
    cluster = PrivateCluster(directory, fsync=False).start()
    try:
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture
def database_url(pg_cluster: PrivateCluster) -> str:
    """A new, empty database on the session's cluster."""
    import psycopg

    name = f"test_{next(_names)}"
    admin = pg_cluster.url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name}")
        conn.execute(f"CREATE DATABASE {name} TEMPLATE template0")
    assert DATABASE and ROLE
    return pg_cluster.url.rsplit("/", 1)[0] + f"/{name}"
