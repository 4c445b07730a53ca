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
from pathlib import Path

import pytest

from service.state.pg_cluster import DATABASE, ROLE, PrivateCluster, find_binaries

_names = itertools.count(1)
_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    """Every test here runs against a PostgreSQL cluster (a process of its own): `slow`,
    so `pytest -m "not slow"` leaves them out. The compose file's schema check needs no
    cluster and stays in the fast loop."""
    for item in items:
        path = Path(item.path).resolve()
        if path.parent == _HERE and path.name != "test_compose_replicas.py":
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PrivateCluster]:
    if find_binaries() is None:
        pytest.skip(
            "no PostgreSQL binaries (initdb, pg_ctl) on this machine: install "
            "postgresql (scripts/test.sh does as root) to run the replica tests"
        )
    directory = tempfile.mkdtemp(prefix="lattice-pg-")
    cluster = PrivateCluster(directory, fsync=False).start()
    try:
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture
def database_url(pg_cluster: PrivateCluster) -> Iterator[str]:
    """A new, empty database on the session's cluster. After the test, whatever it did,
    the queue's kept size (`queue_counts`) is the number of queued sequences."""
    import psycopg

    name = f"test_{next(_names)}"
    admin = pg_cluster.url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name}")
        conn.execute(f"CREATE DATABASE {name} TEMPLATE template0")
    assert DATABASE and ROLE
    url = pg_cluster.url.rsplit("/", 1)[0] + f"/{name}"
    yield url
    with psycopg.connect(url, autocommit=True) as conn:
        if conn.execute("SELECT to_regclass('queue_counts')").fetchone()[0] is not None:
            kept, counted = conn.execute(
                "SELECT (SELECT coalesce(sum(queued), 0) FROM queue_counts), "
                "(SELECT count(*) FROM sequences WHERE state = 1)"
            ).fetchone()
            assert kept == counted, "queue_counts drifted from the queue"


# ------------------------------------------------------------------ in-process replicas

import asyncio  # noqa: E402
import threading  # noqa: E402

import grpc  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from common.waiting import wait_until  # noqa: E402
from lattice.scheduler.v1 import scheduler_pb2 as pb  # noqa: E402
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc  # noqa: E402
from service.core import SchedulerConfig  # noqa: E402
from service.replicas.build import start  # noqa: E402
from service.settings import ServeSettings  # noqa: E402
from tests.server.conftest import LOOPBACK, Server  # noqa: E402
from tests.server.wire import RPC_TIMEOUT_SECONDS, Stream, Worker, admitted  # noqa: E402


def start_replica(
    database_url: str,
    *,
    replica_lease_ms: int = 5000,
    prefetch: int = 8,
    auth_tokens: str = "",
    replica_commit_due_wait_ms: float = ServeSettings.replica_commit_due_wait_ms,
    replica_streams: str = ServeSettings.replica_streams,
    tls: dict[str, str] | None = None,
    **scheduler_config,
) -> Server:
    """One in-process replica on `database_url` (gRPC and metrics on free ports), with
    the tokens file `auth_tokens` if given (`Server.stub` then sends no token); `tls`:
    the TLS settings (tls_cert, tls_key, tls_client_ca, replica_peer_ca), and the stub's
    channel credentials under "client_credentials"."""
    tls = dict(tls or {})
    client_credentials = tls.pop("client_credentials", None)
    scheduler_config.setdefault("policy", "fifo")
    config = SchedulerConfig(**scheduler_config)
    settings = ServeSettings(
        host=LOOPBACK,
        port=0,
        metrics_port=0,
        state=database_url,
        prefetch=prefetch,
        auth_tokens=auth_tokens,
        replica_lease_ms=replica_lease_ms,
        replica_commit_due_wait_ms=replica_commit_due_wait_ms,
        replica_streams=replica_streams,
        scheduler=config,
        **tls,
    )
    registry = CollectorRegistry()
    running = start(settings, registry)
    target = f"{LOOPBACK}:{running.port}"
    channel = (
        grpc.secure_channel(target, client_credentials)
        if client_credentials is not None
        else grpc.insecure_channel(target)
    )
    grpc.channel_ready_future(channel).result(timeout=RPC_TIMEOUT_SECONDS)
    return Server(running, registry, config, channel, pb_grpc.SchedulerStub(channel))


@pytest.fixture
def start_replicas(database_url):
    """Factory: start_replicas(n, **config) -> [Server]; every one stopped at teardown."""
    started: list[Server] = []

    def factory(count: int = 2, **config) -> list[Server]:
        new = [start_replica(database_url, **config) for _ in range(count)]
        started.extend(new)
        return new

    yield factory
    stoppers = [threading.Thread(target=s.stop) for s in started]
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join(15)


def crash(server) -> None:
    """Stop a replica as kill -9 would leave the database: no hand-back, its lease left to
    run out (its tasks, listener and servers stop; nothing is written on the way)."""
    running = server.running

    async def halt(serving) -> None:
        for task in serving.tasks:
            task.cancel()
        await asyncio.gather(*serving.tasks, return_exceptions=True)
        serving.servicer._listener_stop.set()
        await asyncio.gather(*(s.stop(0) for s in serving.servers))

    running._loop.run(halt(running._serving), timeout=30)  # fails, not hangs
    running.store.close()
    running._loop.close()
    running.metrics_http.shutdown()
    running.metrics_http.server_close()
    running._stopped = server._stopped = True  # nothing left to stop at teardown


def count_reads(server) -> list[int]:
    """Count `server`'s reads of sequences' output from the database from now on (the
    count is the list's one item)."""
    state = server.running._serving.servicer._state
    reads = [0]
    read_output = state.read_output

    def counted(*args, **kwargs):
        reads[0] += 1
        return read_output(*args, **kwargs)

    state.read_output = counted
    return reads


def stream_across(owner, streamer):
    """A Generate stream on `streamer` of a sequence that a worker of `owner` runs, its
    first token not yet reported: (the worker, the stream, the seq_id, `streamer`'s
    reads of the database counted from before the stream began)."""
    worker = Worker(owner.stub, "w")
    worker.register()
    reads = count_reads(streamer)
    stream = Stream(streamer.stub, pb.SubmitRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=64))
    seq_id = stream.next_event().seq_id
    wait_until(lambda: admitted(worker.select()) == [seq_id], "admission on the owner", 10)
    return worker, stream, seq_id, reads
