"""Real servers on loopback for the wire-contract tests.

`server` starts one in-process scheduler on 127.0.0.1 (gRPC and metrics on free ports,
its own CollectorRegistry) and stops it at teardown. Parametrize its SchedulerConfig
indirectly:

    @pytest.mark.parametrize("server", [{"max_queue": 2}], indirect=True)
    def test_...(server): ...

or start more than one with `start_server(**scheduler_config)`.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from service.core import SchedulerConfig
from service.server.app import RunningServer, start
from service.settings import ServeSettings

from .wire import RPC_TIMEOUT_SECONDS, Worker

LOOPBACK = "127.0.0.1"
METRIC_PREFIX = "lattice_scheduler_"


@dataclass
class Server:
    """One running scheduler and a client channel to it."""

    running: RunningServer
    registry: CollectorRegistry
    config: SchedulerConfig
    channel: grpc.Channel
    stub: pb_grpc.SchedulerStub
    _stopped: bool = field(default=False)

    @property
    def target(self) -> str:
        return f"{LOOPBACK}:{self.running.port}"

    def metric(self, name: str, **labels: str) -> float | None:
        """A sample's value from the server's registry (None when the series is absent).

        `name` may omit the `lattice_scheduler_` prefix.
        """
        full = name if name.startswith(METRIC_PREFIX) else METRIC_PREFIX + name
        return self.registry.get_sample_value(full, labels)

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """GET /metrics over HTTP: {(sample name, sorted labels): value}."""
        url = f"http://{LOOPBACK}:{self.running.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=RPC_TIMEOUT_SECONDS) as resp:
            text = resp.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def stop(self, grace_seconds: float = 0.0) -> None:
        if not self._stopped:
            self._stopped = True
            self.channel.close()
            self.running.stop(grace_seconds)


def _start(state_dir: str = "", serve: dict | None = None, **scheduler_config) -> Server:
    # The contract's numbered rules are fifo's: tests name another policy when they mean it.
    scheduler_config.setdefault("policy", "fifo")
    config = SchedulerConfig(**scheduler_config)
    settings = ServeSettings(
        host=LOOPBACK,
        port=0,
        metrics_port=0,
        state_dir=state_dir,
        scheduler=config,
        **(serve or {}),
    ).validate()
    registry = CollectorRegistry()
    running = start(settings, registry)
    channel = grpc.insecure_channel(f"{LOOPBACK}:{running.port}")
    grpc.channel_ready_future(channel).result(timeout=RPC_TIMEOUT_SECONDS)
    return Server(running, registry, config, channel, pb_grpc.SchedulerStub(channel))


@pytest.fixture(scope="session")
def server_stoppers() -> Iterator[list[threading.Thread]]:
    """Threads stopping servers; the session waits for every one of them at its end."""
    threads: list[threading.Thread] = []
    yield threads
    for t in threads:
        t.join(timeout=10)
        assert not t.is_alive(), "a test server did not stop within 10 s"


@pytest.fixture
def start_server(server_stoppers) -> Iterator[Callable[..., Server]]:
    """Factory: start_server([state_dir], serve={ServeSettings fields}, **SchedulerConfig
    fields) -> Server; all stopped at teardown.

    Stopping runs in a thread: the gRPC server stops at once, but the metrics HTTP
    server's shutdown() waits out its 0.5 s poll interval, which would otherwise
    dominate the suite's run time.
    """
    servers: list[Server] = []

    def factory(state_dir: str = "", serve: dict | None = None, **scheduler_config) -> Server:
        servers.append(_start(state_dir, serve, **scheduler_config))
        return servers[-1]

    yield factory
    for s in servers:
        stopper = threading.Thread(target=s.stop, name="stop-test-server")
        stopper.start()
        server_stoppers.append(stopper)


@pytest.fixture
def server(request, start_server) -> Server:
    """One scheduler; indirect parametrization passes SchedulerConfig overrides as a dict."""
    return start_server(**getattr(request, "param", {}))


@pytest.fixture
def stub(server) -> pb_grpc.SchedulerStub:
    return server.stub


@pytest.fixture
def transport() -> str:
    """How fake workers report: "unary" here; test_contract.py runs both transports."""
    return "unary"


@pytest.fixture
def make_worker(stub, transport) -> Iterator[Callable[[str], Worker]]:
    """Factory: make_worker(worker_id) -> a fake worker on the `server` fixture, speaking
    `transport`; their sessions are closed at teardown."""
    made: list[Worker] = []

    def factory(worker_id: str = "w1") -> Worker:
        made.append(Worker(stub, worker_id, transport))
        return made[-1]

    yield factory
    for w in made:
        w.close()


@pytest.fixture
def worker(make_worker) -> Worker:
    """A fake worker "w1" on the `server` fixture (not yet registered)."""
    return make_worker("w1")
