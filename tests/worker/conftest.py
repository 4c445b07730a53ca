"""A real scheduler on a loopback port, and helpers to run worker loops beside it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client import CollectorRegistry

from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from service.core import SchedulerConfig
from service.server.app import RunningServer, start
from service.settings import ServeSettings
from worker_client.client import RetryPolicy, SchedulerClient, WorkerResources
from worker_client.loop import WorkerLoop


def start_scheduler(**config) -> RunningServer:
    """A scheduler on a free loopback port; its metrics registry is `.registry`."""
    settings = ServeSettings(
        host="127.0.0.1", port=0, metrics_port=0, scheduler=SchedulerConfig(**config)
    )
    registry = CollectorRegistry()
    server = start(settings, registry)
    server.registry = registry
    return server


@pytest.fixture
def scheduler(request) -> Iterator[RunningServer]:
    config = getattr(request, "param", {})
    server = start_scheduler(**config)
    yield server
    server.stop(0)


@pytest.fixture
def stub(scheduler) -> Iterator[pb_grpc.SchedulerStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{scheduler.port}")
    yield pb_grpc.SchedulerStub(channel)
    channel.close()


class WorkerThread:
    """A WorkerLoop on its own thread, with its stop and drain switches."""

    def __init__(
        self,
        port: int,
        worker_id: str,
        engine,
        *,
        max_batch_size: int = 0,
        retry: RetryPolicy = RetryPolicy(total_seconds=5.0),
        session: bool = True,
        overlap: bool = True,
    ) -> None:
        self.engine = engine
        self.client = SchedulerClient(
            f"127.0.0.1:{port}", call_timeout_seconds=5.0, retry=retry, session=session
        )
        resources = WorkerResources.of(worker_id, engine, max_batch_size)
        self.loop = WorkerLoop(
            engine, self.client, resources, idle_sleep_seconds=0.002, overlap=overlap
        )
        self.stop = threading.Event()
        self.drain = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.loop.run(self.stop, self.drain)
        except BaseException as err:  # noqa: BLE001 - surfaced by join()
            self.error = err

    def start(self) -> WorkerThread:
        self._thread.start()
        return self

    def join(self, timeout: float = 20.0) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "worker loop did not stop in time"
        self.client.close()
        if self.error is not None:
            raise self.error


def generate(
    stub: pb_grpc.SchedulerStub, prompt, max_new_tokens: int, timeout: float = 30.0, **fields
) -> tuple[int, list[int], list[pb.GenerateEvent]]:
    """Run one Generate stream to its end: (seq_id, tokens, events)."""
    events = list(
        stub.Generate(
            pb.SubmitRequest(prompt_token_ids=prompt, max_new_tokens=max_new_tokens, **fields),
            timeout=timeout,
        )
    )
    tokens = [t for e in events for t in e.token_ids]
    return events[0].seq_id, tokens, events
