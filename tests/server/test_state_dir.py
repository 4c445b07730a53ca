"""--state-dir over the wire: a restarted server answers for what the old one accepted."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client import CollectorRegistry

from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from service.core import ConfigError
from service.server.app import RunningServer, start
from service.settings import ServeSettings

from .conftest import LOOPBACK
from .wire import RPC_TIMEOUT_SECONDS, Worker

FINISH_MAX_LENGTH = pb.FINISH_REASON_MAX_LENGTH


class Durable:
    """An in-process server on a state dir; restart() stops it and starts a new one."""

    def __init__(self, state_dir) -> None:
        self.state_dir = str(state_dir)
        self.running: RunningServer | None = None
        self.channel: grpc.Channel | None = None
        self.restart()

    def restart(self) -> pb_grpc.SchedulerStub:
        self.stop()
        settings = ServeSettings(host=LOOPBACK, port=0, metrics_port=0, state_dir=self.state_dir)
        self.running = start(settings, CollectorRegistry())
        self.channel = grpc.insecure_channel(f"{LOOPBACK}:{self.running.port}")
        self.stub = pb_grpc.SchedulerStub(self.channel)
        return self.stub

    def stop(self) -> None:
        if self.running is not None:
            self.running.stop(0)  # first: closing the channel first would be a client leaving
            self.channel.close()
            self.running = None


@pytest.fixture
def durable(tmp_path):
    server = Durable(tmp_path / "state")
    yield server
    server.stop()


def _submit(stub, request_id: str, max_new_tokens: int = 4) -> int:
    return stub.Submit(
        pb.SubmitRequest(
            request_id=request_id, prompt_token_ids=[1, 2, 3], max_new_tokens=max_new_tokens
        ),
        timeout=RPC_TIMEOUT_SECONDS,
    ).seq_id


def test_generate_with_a_known_request_id_re_attaches_from_the_first_token(durable):
    seq_id = _submit(durable.stub, "job-1")
    worker = Worker(durable.stub, "w1")
    worker.register()
    worker.select()
    worker.select(running=[seq_id], tokens={seq_id: [11, 12]})

    stub = durable.restart()
    events = stub.Generate(
        pb.SubmitRequest(request_id="job-1", prompt_token_ids=[1, 2, 3], max_new_tokens=4),
        timeout=RPC_TIMEOUT_SECONDS,
    )
    first = next(events)
    assert first.seq_id == seq_id
    replay = next(events)
    assert list(replay.token_ids) == [11, 12]
    # The recovered worker carries on without registering again.
    Worker(stub, "w1").select(running=[seq_id], tokens={seq_id: [13, 14]})
    Worker(stub, "w1").select(finished=[(seq_id, FINISH_MAX_LENGTH, 4)])
    rest = list(events)
    assert [t for e in rest for t in e.token_ids] == [13, 14]
    assert rest[-1].finished and rest[-1].finish_reason == FINISH_MAX_LENGTH
    assert sum(e.finished for e in rest) == 1


def test_acknowledged_sequences_are_known_after_a_restart_and_ids_go_on(durable):
    ids = [_submit(durable.stub, f"r{i}") for i in range(5)]
    stub = durable.restart()
    infos = [
        stub.GetSequence(pb.GetSequenceRequest(seq_id=s), timeout=RPC_TIMEOUT_SECONDS) for s in ids
    ]
    assert [i.state for i in infos] == [pb.SEQUENCE_STATE_QUEUED] * 5
    assert [i.queue_position for i in infos] == [0, 1, 2, 3, 4]
    assert _submit(stub, "r2") == ids[2]  # idempotent across the restart
    assert _submit(stub, "new") == ids[-1] + 1  # ids never reused


def test_a_second_server_on_the_same_state_dir_is_refused(durable):
    settings = ServeSettings(host=LOOPBACK, port=0, metrics_port=0, state_dir=durable.state_dir)
    with pytest.raises(ConfigError, match="in use by another scheduler"):
        start(settings, CollectorRegistry())


def test_a_failed_start_releases_the_state_dir(tmp_path):
    busy = ServeSettings(host=LOOPBACK, port=0, metrics_port=0)
    first = start(busy, CollectorRegistry())
    try:
        clash = ServeSettings(
            host=LOOPBACK, port=first.port, metrics_port=0, state_dir=str(tmp_path)
        )
        with pytest.raises(ConfigError, match=f"gRPC port {first.port} .* already in use"):
            start(clash, CollectorRegistry())
    finally:
        first.stop(0)
    # The lock went with the failed start: the directory serves the next one.
    again = start(
        ServeSettings(host=LOOPBACK, port=0, metrics_port=0, state_dir=str(tmp_path)),
        CollectorRegistry(),
    )
    again.stop(0)


def test_stopping_the_server_does_not_cancel_what_its_streams_were_watching(durable):
    events = durable.stub.Generate(
        pb.SubmitRequest(request_id="watched", prompt_token_ids=[1, 2, 3], max_new_tokens=4),
        timeout=RPC_TIMEOUT_SECONDS,
    )
    seq_id = next(events).seq_id
    stub = durable.restart()  # a graceful stop ends the stream from the server's side
    with pytest.raises(grpc.RpcError):
        list(events)
    info = stub.GetSequence(pb.GetSequenceRequest(seq_id=seq_id), timeout=RPC_TIMEOUT_SECONDS)
    assert info.state == pb.SEQUENCE_STATE_QUEUED
