"""How `serve --state postgresql://...` builds a replica: its store and its servicer,
handed to the server's start as a `Shared` (the server package does not import this one).
"""

from __future__ import annotations

import functools
import logging
import socket

import grpc
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily

from common.credentials import channel_credentials
from service.core import Scheduler
from service.core.decide.orders import queue_order
from service.replicas.peers import Peers
from service.replicas.servicer import ReplicaServicer
from service.server import app
from service.server.interceptors.auth import Callers
from service.server.loop_lag import LoopLag
from service.server.metrics import SchedulerMetrics
from service.server.wakeups import Wakeups
from service.settings import ServeSettings
from service.state.postgres import PostgresState

log = logging.getLogger(__name__)


def open_store(settings: ServeSettings, registry: CollectorRegistry) -> PostgresState:
    """Connect to the shared database (creating the schema) and take a replica lease;
    its round trips are counted in `registry`."""
    store = PostgresState(
        settings.state,
        name=f"{socket.gethostname()}:{settings.port}",
        lease_ttl_seconds=settings.replica_lease_ms / 1000.0,
        affinity_seconds=settings.replica_affinity_ms / 1000.0,
        fsync=settings.state_fsync,
        order=queue_order(settings.scheduler),
    )
    registry.register(_RoundTrips(store))
    return store


class _RoundTrips:
    """lattice_scheduler_database_round_trips_total{purpose}: save, submit, claim, watch
    (the watcher's statement, one a reading); and
    lattice_scheduler_database_commits_total, ..._saves_committed_total."""

    def __init__(self, store: PostgresState) -> None:
        self._store = store

    def collect(self):
        family = CounterMetricFamily(
            "lattice_scheduler_database_round_trips",
            "Blocking exchanges of this replica with PostgreSQL, by purpose",
            labels=["purpose"],
        )
        for purpose in ("save", "submit", "claim", "watch"):
            family.add_metric([purpose], self._store.round_trips[purpose])
        yield family
        commits = CounterMetricFamily(
            "lattice_scheduler_database_commits",
            "Group commits of this replica's saves (each holds one or more saves)",
        )
        commits.add_metric([], self._store.num_commits)
        yield commits
        saves = CounterMetricFamily(
            "lattice_scheduler_database_saves_committed",
            "Saves of this replica's core committed (by group commits)",
        )
        saves.add_metric([], self._store.num_saves_committed)
        yield saves


def make_servicer(
    core: Scheduler,
    wakeups: Wakeups,
    store: PostgresState,
    metrics: SchedulerMetrics,
    lag: LoopLag,
    settings: ServeSettings,
    callers: Callers,
    peer_credentials: grpc.ChannelCredentials | None = None,
) -> ReplicaServicer:
    """The replica's servicer over `core`, claiming `settings.prefetch` ahead."""
    return ReplicaServicer(
        core,
        wakeups,
        store,
        metrics=metrics,
        lag=lag,
        prefetch=settings.prefetch,
        callers=callers,
        commit_wait_seconds=settings.replica_commit_wait_ms / 1000.0,
        commit_due_wait_seconds=settings.replica_commit_due_wait_ms / 1000.0,
        watch_seconds=settings.replica_watch_ms / 1000.0,
        peers=_peers(settings, store, metrics, peer_credentials),
        advertise=lambda port: settings.replica_address or f"{_host(settings.host)}:{port}",
    )


def _peers(
    settings: ServeSettings,
    store: PostgresState,
    metrics: SchedulerMetrics,
    credentials: grpc.ChannelCredentials | None,
) -> Peers | None:
    """Whom streams of other replicas' sequences are relayed from (None: they read the
    database): plaintext without TLS; with TLS on, only over `credentials`."""
    if settings.replica_streams != "owner":
        return None
    if settings.tls_cert and credentials is None:
        log.info(
            "TLS is on and --replica-peer-ca is not given: streams of other replicas' "
            "sequences read PostgreSQL instead of being relayed from their owner"
        )
        return None
    return Peers(
        store.address_of,
        max_message_bytes=settings.max_message_bytes,
        on_follow=metrics.on_replica_follow,
        credentials=credentials,
    )


def _peer_credentials(settings: ServeSettings) -> grpc.ChannelCredentials | None:
    """TLS toward the other replicas (--replica-peer-ca), showing this replica's own
    certificate to those that ask for one (mTLS); None without. Its files are read here,
    before the store opens: an unreadable one is a ConfigError that names its flag."""
    if not (settings.tls_cert and settings.replica_peer_ca):
        return None
    return channel_credentials(
        settings.replica_peer_ca, settings.tls_cert, settings.tls_key, "--replica-peer-ca"
    )


def _host(host: str) -> str:
    """The host part of where other replicas reach one listening on `host`."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        return socket.gethostname()
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _shared(settings: ServeSettings) -> app.Shared:
    return app.Shared(
        open_store=open_store,
        make_servicer=functools.partial(
            make_servicer, peer_credentials=_peer_credentials(settings)
        ),
    )


def start(settings: ServeSettings, registry: CollectorRegistry | None = None) -> app.RunningServer:
    """Start a replica on the database settings.state names (as service.server.app.start)."""
    return app.start(settings, registry, shared=_shared(settings))


def serve(settings: ServeSettings) -> None:
    """Run a replica until SIGTERM or SIGINT (as service.server.app.serve)."""
    app.serve(settings, shared=_shared(settings))
