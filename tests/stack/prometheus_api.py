"""A Prometheus started by the tests: its HTTP API and its config."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from .stack_files import ALERTS, PROMETHEUS_CONFIG

LOOPBACK = "127.0.0.1"
PROMETHEUS_READY_SECONDS = 30.0
SCHEDULER_JOB = "lattice-scheduler"
GATEWAY_JOB = "lattice-gateway"


class PrometheusApi:
    """The HTTP API of a Prometheus started by the tests."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def get(self, path: str, **params: str) -> dict:
        """GET an /api/v1 path; the decoded body, also for 4xx answers (they carry `error`)."""
        url = f"{self.base_url}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            return json.loads(err.read())

    def query(self, expr: str) -> dict:
        return self.get("/api/v1/query", query=expr)

    def scalar_of(self, expr: str) -> float | None:
        """The value of a one-series instant query, None while it has no result."""
        body = self.query(expr)
        assert body["status"] == "success", f"{expr!r}: {body.get('error')}"
        result = body["data"]["result"]
        return float(result[0]["value"][1]) if len(result) == 1 else None


def scrape_config_for_test(metrics_port: int, prometheus_port: int, gateway_port: int) -> dict:
    """deploy/prometheus/prometheus.yml, aimed at loopback and scraping every second."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(PROMETHEUS_CONFIG.parent / name) for name in config["rule_files"]]
    targets = {
        SCHEDULER_JOB: f"{LOOPBACK}:{metrics_port}",
        GATEWAY_JOB: f"{LOOPBACK}:{gateway_port}",
        "prometheus": f"{LOOPBACK}:{prometheus_port}",
    }
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
    assert ALERTS.name in {Path(p).name for p in config["rule_files"]}
    return config
