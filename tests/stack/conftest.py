"""Fixtures of the stack tests: a real scheduler on loopback, known activity on it, and a
real Prometheus (the Debian binary) scraping it every second.

Prometheus-backed tests skip, saying why, only when the prometheus/promtool binaries are
missing; scripts/test.sh installs them where it can.
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc

from service.core import SchedulerConfig
from service.server import RunningServer, start
from service.settings import ServeSettings
from tests.stack.stack_files import ALERTS, PROMETHEUS_CONFIG

LOOPBACK = "127.0.0.1"
PROMETHEUS_READY_SECONDS = 30.0
SCHEDULER_JOB = "lattice-scheduler"


def _binary_or_skip(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not on PATH; install Prometheus (Debian: apt-get install -y "
                    f"prometheus, as scripts/test.sh does as root) to run this check")
    return path


@pytest.fixture(scope="session")
def promtool() -> str:
    return _binary_or_skip("promtool")


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    return _binary_or_skip("prometheus")


@dataclass(frozen=True)
class KnownActivity:
    """What the session fixture does through gRPC, and what the metrics must show after."""

    num_submitted: int = 5
    worker_id: str = "stack-worker-1"
    max_batch_size: int = 2
    total_kv_pages: int = 64
    total_gdn_slots: int = 8
    kv_free_pages: int = 40
    gdn_free_slots: int = 7

    @property
    def num_admitted(self) -> int:
        return self.max_batch_size  # one SelectBatch from an empty worker fills its batch

    @property
    def queue_depth(self) -> int:
        return self.num_submitted - self.num_admitted


@pytest.fixture(scope="session")
def scheduler() -> RunningServer:
    # A lease far longer than the session, so the worker's series stay while Prometheus scrapes.
    settings = ServeSettings(host=LOOPBACK, port=0, metrics_port=0,
                             scheduler=SchedulerConfig(lease_ttl_ms=600_000))
    running = start(settings)
    yield running
    running.stop(0)


@pytest.fixture(scope="session")
def activity(scheduler: RunningServer) -> KnownActivity:
    known = KnownActivity()
    with grpc.insecure_channel(f"{LOOPBACK}:{scheduler.port}") as channel:
        stub = pb_grpc.SchedulerStub(channel)
        for index in range(known.num_submitted):
            stub.Submit(pb.SubmitRequest(prompt_token_ids=[1 + index, 2, 3, 4],
                                         max_new_tokens=4), timeout=5)
        stub.RegisterWorker(pb.RegisterWorkerRequest(
            worker_id=known.worker_id, total_kv_pages=known.total_kv_pages, page_size=16,
            total_gdn_slots=known.total_gdn_slots, max_batch_size=known.max_batch_size),
            timeout=5)
        decision = stub.SelectBatch(pb.SelectBatchRequest(
            worker_id=known.worker_id, kv_free_pages=known.kv_free_pages,
            gdn_free_slots=known.gdn_free_slots), timeout=5)
    assert len(decision.prefill) == known.num_admitted, decision
    return known


def fetch_metrics_text(scheduler: RunningServer) -> str:
    url = f"http://{LOOPBACK}:{scheduler.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


@pytest.fixture(scope="session")
def metrics_text(scheduler: RunningServer, activity: KnownActivity) -> str:
    """The live /metrics text after the known activity (per-worker series included)."""
    return fetch_metrics_text(scheduler)


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


def wait_until(probe, done, what: str, timeout_seconds: float = PROMETHEUS_READY_SECONDS,
               every_seconds: float = 0.25):
    """Call probe() until done(its value); return that value, or fail naming `what` and
    showing the last value after timeout_seconds."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        value = probe()
        if done(value):
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout_seconds:g} s for {what}; last saw {value!r}")
        time.sleep(every_seconds)


def _free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def scrape_config_for_test(metrics_port: int, prometheus_port: int) -> dict:
    """deploy/prometheus/prometheus.yml, aimed at loopback and scraping every second."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(PROMETHEUS_CONFIG.parent / name)
                            for name in config["rule_files"]]
    targets = {SCHEDULER_JOB: f"{LOOPBACK}:{metrics_port}",
               "prometheus": f"{LOOPBACK}:{prometheus_port}"}
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
    assert ALERTS.name in {Path(p).name for p in config["rule_files"]}
    return config


@pytest.fixture(scope="session")
def prometheus(prometheus_binary: str, scheduler: RunningServer, activity: KnownActivity,
               tmp_path_factory: pytest.TempPathFactory) -> PrometheusApi:
    """A real Prometheus on loopback whose scheduler target is up (scraped at least twice)."""
    workdir = tmp_path_factory.mktemp("prometheus")
    port = _free_loopback_port()
    config_file = workdir / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(scrape_config_for_test(scheduler.metrics_port, port)))
    log_file = (workdir / "prometheus.log").open("w")
    process = subprocess.Popen(
        [prometheus_binary, f"--config.file={config_file}",
         f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address={LOOPBACK}:{port}"],
        stdout=log_file, stderr=subprocess.STDOUT, cwd=workdir)
    api = PrometheusApi(f"http://{LOOPBACK}:{port}")
    try:
        def scheduler_scraped_twice():
            if process.poll() is not None:
                pytest.fail(f"prometheus exited with {process.returncode}:\n"
                            + (workdir / "prometheus.log").read_text()[-3000:])
            try:
                # count_over_time > 1: rate() in the dashboard needs two samples.
                value = api.scalar_of(
                    f'count_over_time(up{{job="{SCHEDULER_JOB}"}}[1m]) > 1 '
                    f'and up{{job="{SCHEDULER_JOB}"}} == 1')
            except (OSError, json.JSONDecodeError):
                return False  # not listening yet
            return value is not None
        wait_until(scheduler_scraped_twice, bool, "Prometheus to scrape the scheduler twice")
        yield api
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log_file.close()
