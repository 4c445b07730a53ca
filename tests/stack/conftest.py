"""Fixtures of the stack tests: a real scheduler on loopback, known activity on it, the
OpenAI gateway (in front of a second scheduler with a scripted worker) with a few requests
through it, and a real Prometheus (the Debian binary) scraping both every second.

Prometheus-backed tests skip, saying why, only when the prometheus/promtool binaries are
missing; scripts/test.sh installs them where it can.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import grpc
import pytest
import yaml

from common.processes import free_port
from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from service.core import SchedulerConfig
from service.server.app import RunningServer, start
from service.settings import ServeSettings

from .prometheus_api import (
    GATEWAY_JOB,
    LOOPBACK,
    PROMETHEUS_READY_SECONDS,
    SCHEDULER_JOB,
    PrometheusApi,
    scrape_config_for_test,
)


def _binary_or_skip(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(
            f"{name} is not on PATH; install Prometheus (Debian: apt-get install -y "
            f"prometheus, as scripts/test.sh does as root) to run this check"
        )
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

    # Two reports: the empty worker's (it gets its batch), then the one after its step
    # (with the step's time), which holds the batch running.
    num_reports = 2

    @property
    def num_running(self) -> int:
        return self.num_admitted


@pytest.fixture(scope="session")
def scheduler() -> RunningServer:
    # A lease far longer than the session, so the worker's series stay while Prometheus
    # scrapes; a TPOT target so that the step-time series (learned only with a target) exist.
    settings = ServeSettings(
        host=LOOPBACK,
        port=0,
        metrics_port=0,
        scheduler=SchedulerConfig(lease_ttl_ms=600_000, tpot_target_ms=1000.0),
    )
    running = start(settings)
    yield running
    running.stop(0)


@pytest.fixture(scope="session")
def activity(scheduler: RunningServer) -> KnownActivity:
    known = KnownActivity()
    with grpc.insecure_channel(f"{LOOPBACK}:{scheduler.port}") as channel:
        stub = pb_grpc.SchedulerStub(channel)
        for index in range(known.num_submitted):
            stub.Submit(
                pb.SubmitRequest(prompt_token_ids=[1 + index, 2, 3, 4], max_new_tokens=4), timeout=5
            )
        stub.RegisterWorker(
            pb.RegisterWorkerRequest(
                worker_id=known.worker_id,
                total_kv_pages=known.total_kv_pages,
                page_size=16,
                total_gdn_slots=known.total_gdn_slots,
                max_batch_size=known.max_batch_size,
            ),
            timeout=5,
        )
        decision = stub.SelectBatch(
            pb.SelectBatchRequest(
                worker_id=known.worker_id,
                kv_free_pages=known.kv_free_pages,
                gdn_free_slots=known.gdn_free_slots,
            ),
            timeout=5,
        )
        assert len(decision.prefill) == known.num_admitted, decision
        # The step that ran it, timed: the step-time model's first measurement. A step
        # time is learned only if it fits in the time since its decision was answered
        # (docs/contract.md, "Step times"): the 20 ms step takes 30 ms here.
        time.sleep(0.03)
        stub.SelectBatch(
            pb.SelectBatchRequest(
                worker_id=known.worker_id,
                kv_free_pages=known.kv_free_pages,
                gdn_free_slots=known.gdn_free_slots,
                last_step_us=20_000,
                running=[chunk.seq_id for chunk in decision.prefill],
            ),
            timeout=5,
        )
    return known


def fetch_metrics_text(scheduler: RunningServer) -> str:
    url = f"http://{LOOPBACK}:{scheduler.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


@pytest.fixture(scope="session")
def metrics_text(scheduler: RunningServer, activity: KnownActivity) -> str:
    """The live /metrics text after the known activity (per-worker series included)."""
    return fetch_metrics_text(scheduler)


@dataclass(frozen=True)
class GatewayActivity:
    """A gateway that answered one streamed chat completion and one bad request."""

    port: int

    @property
    def metrics_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}/metrics"


@pytest.fixture(scope="session")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> GatewayActivity:
    """`lattice-scheduler gateway` in front of its own scheduler and a scripted worker (so
    that the known activity above stays as it is), after a few requests through it."""
    from common.processes import (
        GATEWAY_LISTENING,
        SCHEDULER_LISTENING,
        START_TIMEOUT_SECONDS,
        gateway_argv,
        scheduler_argv,
        spawn,
        worker_argv,
    )
    from worker_client.demo_model import build_tokenizer, write_tokenizer_files

    workdir = tmp_path_factory.mktemp("gateway")
    model_dir = workdir / "model"
    write_tokenizer_files(model_dir, build_tokenizer(512))
    started = []
    try:
        scheduler = spawn("gateway-scheduler", scheduler_argv(), workdir, SCHEDULER_LISTENING)
        started.append(scheduler)
        target = f"{LOOPBACK}:{scheduler.ports[0]}"
        started.append(
            spawn("scripted-worker", worker_argv(target, "scripted-worker", "scripted"), workdir)
        )
        gateway = spawn("gateway", gateway_argv(target, model_dir), workdir, GATEWAY_LISTENING)
        started.append(gateway)
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.SchedulerStub(channel)
            wait_until(
                lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=5).workers,
                "the scripted worker to register",
                START_TIMEOUT_SECONDS,
                gone=started[1].exit_reason,
            )
        base = f"http://{LOOPBACK}:{gateway.ports[0]}"
        _post(
            f"{base}/v1/chat/completions",
            {
                "model": "model",
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 16,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        with pytest.raises(urllib.error.HTTPError):
            _post(f"{base}/v1/completions", {"model": "model", "prompt": "hi", "n": 9})
        yield GatewayActivity(gateway.ports[0])
    finally:
        for process in reversed(started):
            process.stop()


def _post(url: str, body: dict) -> bytes:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read()


@pytest.fixture(scope="session")
def gateway_metrics_text(gateway: GatewayActivity) -> str:
    with urllib.request.urlopen(gateway.metrics_url, timeout=5) as response:
        return response.read().decode()


@pytest.fixture(scope="session")
def prometheus(
    prometheus_binary: str,
    scheduler: RunningServer,
    activity: KnownActivity,
    gateway: GatewayActivity,
    tmp_path_factory: pytest.TempPathFactory,
) -> PrometheusApi:
    """A real Prometheus on loopback whose scheduler and gateway targets are up (scraped at
    least twice each)."""
    workdir = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    config_file = workdir / "prometheus.yml"
    config_file.write_text(
        yaml.safe_dump(scrape_config_for_test(scheduler.metrics_port, port, gateway.port))
    )
    log_file = (workdir / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            prometheus_binary,
            f"--config.file={config_file}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address={LOOPBACK}:{port}",
        ],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        cwd=workdir,
    )
    api = PrometheusApi(f"http://{LOOPBACK}:{port}")
    try:

        def targets_scraped_twice():
            if process.poll() is not None:
                pytest.fail(
                    f"prometheus exited with {process.returncode}:\n"
                    + (workdir / "prometheus.log").read_text()[-3000:]
                )
            try:
                # count_over_time > 1: rate() in the dashboard needs two samples.
                values = [
                    api.scalar_of(
                        f'count_over_time(up{{job="{job}"}}[1m]) > 1 and up{{job="{job}"}} == 1'
                    )
                    for job in (SCHEDULER_JOB, GATEWAY_JOB)
                ]
            except (OSError, json.JSONDecodeError):
                return False  # not listening yet
            return None not in values

        wait_until(
            targets_scraped_twice,
            "Prometheus to scrape the scheduler and the gateway twice",
            PROMETHEUS_READY_SECONDS,
            every_seconds=0.25,
        )
        yield api
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log_file.close()
