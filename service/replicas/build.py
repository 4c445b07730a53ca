"""How `serve --state postgresql://...` builds a replica's store (app.py builds its servicer).

Kept apart from server.py so the server only asks "a replica?" at two places.
"""
from __future__ import annotations

import socket

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily

from service.core.orders import queue_order
from service.settings import ServeSettings
from service.state.postgres import PostgresState


def open_store(settings: ServeSettings, registry: CollectorRegistry) -> PostgresState:
    """Connect to the shared database (creating the schema) and take a replica lease;
    its round trips are counted in `registry`."""
    store = PostgresState(
        settings.state, name=f"{socket.gethostname()}:{settings.port}",
        lease_ttl_seconds=settings.replica_lease_ms / 1000.0, fsync=settings.state_fsync,
        order=queue_order(settings.scheduler))
    registry.register(_RoundTrips(store))
    return store


class _RoundTrips:
    """lattice_scheduler_database_round_trips_total{purpose}: save, submit, claim."""

    def __init__(self, store: PostgresState) -> None:
        self._store = store

    def collect(self):
        family = CounterMetricFamily(
            "lattice_scheduler_database_round_trips",
            "Blocking exchanges of this replica with PostgreSQL, by purpose",
            labels=["purpose"])
        for purpose in ("save", "submit", "claim"):
            family.add_metric([purpose], self._store.round_trips[purpose])
        yield family

