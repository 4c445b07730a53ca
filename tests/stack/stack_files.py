"""The stack's files, found from the repository root, and the pieces the tests read out of them."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
COMPOSE_GPU_FILE = REPO / "docker-compose.gpu.yml"
# Vendored (Apache-2.0, compose-spec/compose-spec; see tests/stack/vendor/README.md).
COMPOSE_SCHEMA = Path(__file__).resolve().parent / "vendor" / "compose-spec.json"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
PROMETHEUS_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
ALERTS_TEST = Path(__file__).resolve().parent / "alerts_test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "lattice.json"
GRAFANA_PROVISIONING = REPO / "deploy" / "grafana" / "provisioning"
HEALTH_CHECK_SCRIPT = REPO / "deploy" / "grpc_health_check.py"
OPERATIONS_DOC = REPO / "docs" / "operations.md"


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@dataclass(frozen=True)
class Expression:
    """One PromQL expression and where it comes from, for messages."""

    where: str
    expr: str


def dashboard_expressions() -> list[Expression]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        Expression(f"dashboard panel {panel['title']!r} target {target['refId']}", target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def alert_expressions() -> list[Expression]:
    return [
        Expression(f"alert {rule['alert']}", rule["expr"])
        for group in load_yaml(ALERTS)["groups"]
        for rule in group["rules"]
    ]


@dataclass(frozen=True)
class PublishedPort:
    service: str
    host_port: int
    container_port: int


def compose_ports(compose: dict) -> set[PublishedPort]:
    """Published ports of every service, short ("HOST:CONTAINER") or long syntax."""
    ports = set()
    for name, service in compose["services"].items():
        for entry in service.get("ports", []):
            if isinstance(entry, dict):
                ports.add(PublishedPort(name, int(entry["published"]), int(entry["target"])))
            else:
                host, container = str(entry).split("/")[0].rsplit(":", 2)[-2:]
                ports.add(PublishedPort(name, int(host), int(container)))
    return ports


def documented_ports() -> set[PublishedPort]:
    """Rows of the ports table in docs/operations.md: | service | host port | container port | ..."""
    ports = set()
    for line in OPERATIONS_DOC.read_text().splitlines():
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"\d+", cells[1]) and re.fullmatch(r"\d+", cells[2]):
            ports.add(PublishedPort(cells[0], int(cells[1]), int(cells[2])))
    return ports
