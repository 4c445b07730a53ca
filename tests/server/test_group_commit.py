"""Group commit over the wire: an acknowledgement waits for its fsync, one fsync answers
every Submit that arrived meanwhile, the event loop never waits for the disk, and a
failed fsync acknowledges nothing.

The store's fsync (SqliteStateStore.sync_wal) is replaced by a gate the test opens, so
each test sees exactly when the disk is "done".
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from service.core.persist.store import StoreError
from service.state.sqlite import SqliteStateStore

from .wire import RPC_TIMEOUT_SECONDS, Worker, submit

NUM_SUBMITS = 12


class FsyncGate:
    """Stands in for the WAL's fsync of the stores under `directory`: each call blocks
    until `open()`, and is counted (other stores, such as those of servers still stopping
    from earlier tests, pass through)."""

    opened_at_teardown: list[FsyncGate] = []

    def __init__(self, monkeypatch, directory, fail: bool = False) -> None:
        FsyncGate.opened_at_teardown.append(self)
        self.calls = 0
        self._opened = threading.Event()
        self._fail = fail
        real = SqliteStateStore.sync_wal
        gate = self

        def sync_wal(store) -> None:
            if not store.path.is_relative_to(directory):
                return real(store)
            gate.calls += 1
            gate._opened.wait(30)
            if gate._fail:
                raise StoreError("fsync failed (test)")
            real(store)

        monkeypatch.setattr(SqliteStateStore, "sync_wal", sync_wal)

    def open(self) -> None:
        self._opened.set()


@pytest.fixture(autouse=True)
def _open_gates_at_teardown():
    """Servers stop after the test: a gate left shut would hold their last fsync."""
    yield
    for gate in FsyncGate.opened_at_teardown:
        gate.open()
    FsyncGate.opened_at_teardown.clear()


def _submit_in_threads(stub, count: int) -> tuple[list[threading.Thread], list]:
    answers: list = []

    def one(i: int) -> None:
        try:
            answers.append(submit(stub, request_id=f"r{i}").seq_id)
        except grpc.RpcError as err:
            answers.append(err)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    return threads, answers


def _queue_depth(stub) -> int:
    return stub.GetStatus(pb.GetStatusRequest(), timeout=RPC_TIMEOUT_SECONDS).queue_depth


def test_submits_wait_for_the_fsync_and_one_more_fsync_answers_all_that_came_meanwhile(
    start_server, tmp_path, monkeypatch
):
    gate = FsyncGate(monkeypatch, tmp_path)
    server = start_server(str(tmp_path / "state"))
    threads, answers = _submit_in_threads(server.stub, NUM_SUBMITS)
    wait_until(
        lambda: _queue_depth(server.stub),
        f"{NUM_SUBMITS} submits committed",
        RPC_TIMEOUT_SECONDS,
        done=lambda depth: depth >= NUM_SUBMITS,
        every_seconds=0.01,
    )
    # Every submit is committed and the loop answers other calls, but none is acknowledged.
    assert _queue_depth(server.stub) == NUM_SUBMITS
    assert answers == [] and gate.calls == 1
    gate.open()
    for t in threads:
        t.join(RPC_TIMEOUT_SECONDS)
    assert len(answers) == NUM_SUBMITS and all(isinstance(a, int) for a in answers)
    # The first fsync covered the first submit (and any committed before it began); the
    # second, all that came while it ran.
    assert gate.calls in (1, 2)


def test_worker_progress_does_not_wait_for_the_fsync_under_acks(
    start_server, tmp_path, monkeypatch
):
    gate = FsyncGate(monkeypatch, tmp_path)
    server = start_server(str(tmp_path / "state"))
    worker = Worker(server.stub, "w1")
    worker.register()  # no fsync to wait for: worker changes only
    assert gate.calls == 0
    gate.open()
    threads, answers = _submit_in_threads(server.stub, 1)
    threads[0].join(RPC_TIMEOUT_SECONDS)
    blocked = FsyncGate(monkeypatch, tmp_path)  # from now on every fsync blocks
    started = time.perf_counter()
    assert [c.seq_id for c in worker.select().prefill] == answers
    assert time.perf_counter() - started < 1.0
    assert blocked.calls == 0
    blocked.open()


def test_under_always_worker_progress_waits_for_its_fsync(start_server, tmp_path, monkeypatch):
    server = start_server(str(tmp_path / "state"), serve={"state_fsync": "always"})
    worker = Worker(server.stub, "w1")
    worker.register()
    submit(server.stub)
    gate = FsyncGate(monkeypatch, tmp_path)  # the admission below is a change: it waits
    thread = threading.Thread(target=worker.select, daemon=True)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive() and gate.calls == 1
    gate.open()
    thread.join(RPC_TIMEOUT_SECONDS)
    assert not thread.is_alive()


def test_a_failed_fsync_acknowledges_nothing_then_or_later(start_server, tmp_path, monkeypatch):
    gate = FsyncGate(monkeypatch, tmp_path, fail=True)
    gate.open()
    server = start_server(str(tmp_path / "state"))
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as err:
            submit(server.stub)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "fsync" in err.value.details()
    # Reads still answer; nothing was acknowledged, though the submits are in memory.
    assert _queue_depth(server.stub) == 2


def test_acknowledged_submits_are_there_after_a_restart_with_checkpoints_off_the_loop(
    start_server, tmp_path, monkeypatch
):
    from service.state import group_commit

    monkeypatch.setattr(group_commit, "CHECKPOINT_WAL_BYTES", 1)
    monkeypatch.setattr(group_commit, "CHECKPOINT_CHECK_SECONDS", 0.05)
    state = str(tmp_path / "state")
    server = start_server(state)
    threads, answers = _submit_in_threads(server.stub, NUM_SUBMITS)
    for t in threads:
        t.join(RPC_TIMEOUT_SECONDS)
    time.sleep(0.3)  # a few checkpoints
    server.stop()
    again = start_server(state)
    known = [
        again.stub.GetSequence(pb.GetSequenceRequest(seq_id=s), timeout=RPC_TIMEOUT_SECONDS).seq_id
        for s in answers
    ]
    assert sorted(known) == sorted(answers) and len(answers) == NUM_SUBMITS
