"""A worker's stop event ends every wait of its client within a second: the retries of a
scheduler that is not there, a call in flight to one that does not answer, a session
waiting for a decision; and `lattice-worker` leaves on a signal while it waits."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest

from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from worker_client.client import SchedulerClient, Stopped, WorkerResources
from worker_client.loop import WorkerLoop
from worker_client.session import WorkerSessionStream
from worker_client.testing import ScriptedEngine

STOP_AFTER_SECONDS = 0.3
WITHIN_SECONDS = 1.0


def _refused_port() -> int:
    """A port nobody listens on (calls fail at once with UNAVAILABLE)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _silent_server():
    """Accepts TCP connections and never speaks HTTP/2: a call waits for its deadline."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not done.is_set():
            with contextlib.suppress(OSError):
                accepted.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        done.set()
        thread.join()
        for conn in accepted:
            conn.close()
        listener.close()


def _time_until_return(target, stop: threading.Event) -> float:
    """Seconds from the stop to `target()` returning (it runs on a thread)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            target()
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(STOP_AFTER_SECONDS)
    assert thread.is_alive(), f"returned before the stop: {outcome}"
    stopped_at = time.monotonic()
    stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive(), "still waiting 10 s after the stop"
    assert outcome == [None], outcome  # returned, raised nothing
    return time.monotonic() - stopped_at


def _loop(port: int, stop: threading.Event, *, session: bool) -> WorkerLoop:
    client = SchedulerClient(
        f"127.0.0.1:{port}", stop=stop, session=session, call_timeout_seconds=30.0
    )
    engine = ScriptedEngine()
    resources = WorkerResources(
        "w1", engine.total_kv_pages, engine.page_size, engine.total_gdn_slots
    )
    return WorkerLoop(engine, client, resources)


def test_registration_retrying_an_absent_scheduler_ends_within_a_second_of_stop():
    stop = threading.Event()
    loop = _loop(_refused_port(), stop, session=False)
    assert _time_until_return(lambda: loop.run(stop), stop) < WITHIN_SECONDS
    assert loop.stats.registrations == 0


def test_a_call_in_flight_to_a_silent_scheduler_ends_within_a_second_of_stop():
    stop = threading.Event()
    with _silent_server() as port:
        loop = _loop(port, stop, session=False)
        assert _time_until_return(lambda: loop.run(stop), stop) < WITHIN_SECONDS


def test_a_session_waiting_for_its_decision_ends_within_a_second_of_stop():
    stop = threading.Event()
    with _silent_server() as port, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        session = WorkerSessionStream(pb_grpc.SchedulerStub(channel))

        def exchange() -> None:
            with pytest.raises(grpc.RpcError) as raised:
                session.exchange(pb.SelectBatchRequest(worker_id="w1"), 30.0, stop=stop)
            assert raised.value.code() is grpc.StatusCode.CANCELLED

        assert _time_until_return(exchange, stop) < WITHIN_SECONDS


def test_a_stopped_call_raises_stopped_not_a_call_failure():
    stop = threading.Event()
    client = SchedulerClient(f"127.0.0.1:{_refused_port()}", stop=stop, session=False)
    resources = WorkerResources("w1", 16, 16, 4)
    threading.Timer(STOP_AFTER_SECONDS, stop.set).start()
    with pytest.raises(Stopped):
        client.register(resources)


@pytest.mark.slow  # starts lattice-worker processes
@pytest.mark.parametrize(
    "signals", [(signal.SIGTERM,), (signal.SIGINT,)], ids=["sigterm", "sigint"]
)
def test_lattice_worker_waiting_for_an_absent_scheduler_leaves_on_a_signal(signals):
    process = subprocess.Popen(  # -X faulthandler: a SIGABRT prints every thread's stack
        [
            sys.executable,
            "-X",
            "faulthandler",
            "-m",
            "worker_client",
            "--scheduler",
            f"127.0.0.1:{_refused_port()}",
            "--worker-id",
            "w1",
            "--model",
            "scripted",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # up and retrying
            line = process.stdout.readline()
            if "retrying" in line or not line:
                break
        assert "retrying" in line, line
        sent_at = time.monotonic()
        for signum in signals:
            process.send_signal(signum)
        try:
            code = process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)
            pytest.fail(
                "still running 10 s after the signal; its output and stacks:\n"
                + process.communicate(timeout=10)[0]
            )
        assert time.monotonic() - sent_at < 2 * WITHIN_SECONDS
        assert code == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
