"""How `serve --state postgresql://...` builds a replica: its store and its servicer.

Kept apart from server.py so the server only asks "a replica?" at two places.
"""
from __future__ import annotations

import socket

from service.metrics import SchedulerMetrics
from service.replica import ReplicaServicer
from service.settings import ServeSettings
from service.state_postgres import PostgresState


def open_store(settings: ServeSettings) -> PostgresState:
    """Connect to the shared database (creating the schema) and take a replica lease."""
    return PostgresState(
        settings.state, name=f"{socket.gethostname()}:{settings.port}",
        lease_ttl_seconds=settings.replica_lease_ms / 1000.0, fsync=settings.state_fsync,
        policy=settings.scheduler.policy, aging_seconds=settings.scheduler.aging_seconds)


def replica_servicer(core, store: PostgresState, metrics: SchedulerMetrics,
                     settings: ServeSettings) -> ReplicaServicer:
    return ReplicaServicer(core, store, metrics, prefetch=settings.prefetch)
