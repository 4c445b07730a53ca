"""docker-compose.replicas.yml: valid Compose, and with docker-compose.yml it makes a
PostgreSQL service, two replicas on it, and workers and a gateway that list both."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.stack.stack_files import COMPOSE_FILE, COMPOSE_SCHEMA, REPO, load_yaml

REPLICAS_FILE = REPO / "docker-compose.replicas.yml"


@pytest.fixture(scope="module")
def merged() -> dict:
    """The two files as `docker compose -f A -f B` merges these keys (per service,
    mappings merge and the override's command replaces)."""
    base, override = load_yaml(COMPOSE_FILE), load_yaml(REPLICAS_FILE)
    services = {name: dict(service) for name, service in base["services"].items()}
    for name, service in override["services"].items():
        services.setdefault(name, {}).update(service)
    return {"services": services, "volumes": {**base["volumes"], **override["volumes"]}}


def test_the_replicas_override_validates_against_the_compose_spec_schema():
    validator = jsonschema.Draft7Validator(json.loads(COMPOSE_SCHEMA.read_text()))
    errors = [e.message for e in validator.iter_errors(load_yaml(REPLICAS_FILE))]
    assert errors == []


def test_both_replicas_share_the_postgres_service_and_wait_for_it(merged):
    services = merged["services"]
    for name in ("scheduler", "scheduler-2"):
        command = services[name]["command"]
        assert command[command.index("--state") + 1] == "postgresql://lattice@postgres:5432/lattice"
        assert "--state-dir" not in command
        assert services[name]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "postgres-data" in merged["volumes"]


def test_each_replica_is_reached_by_the_other_at_its_own_service_name(merged):
    # Streams of one replica's sequences on the other are relayed from it at this address.
    for name in ("scheduler", "scheduler-2"):
        command = merged["services"][name]["command"]
        assert command[command.index("--replica-address") + 1] == f"{name}:50051"


def test_workers_list_both_replicas_their_own_first_and_the_gateway_both(merged):
    services = merged["services"]
    firsts = set()
    for name in ("worker-1", "worker-2"):
        command = services[name]["command"]
        targets = command[command.index("--scheduler") + 1].split(",")
        assert sorted(targets) == ["scheduler-2:50051", "scheduler:50051"]
        firsts.add(targets[0])
    assert len(firsts) == 2
    gateway = services["gateway"]["command"]
    assert set(gateway[gateway.index("--target") + 1].split(",")) == {
        "scheduler:50051",
        "scheduler-2:50051",
    }
