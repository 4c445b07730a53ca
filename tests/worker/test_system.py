"""Scheduler + worker loops + Generate streams, end to end, with the scripted engine.

The scripted engine's output is a fixed function of the prefix, so every stream can be
checked token by token against `reference_output`, whatever preemption, worker loss or
re-registration happened on the way.
"""

from __future__ import annotations

import random
import threading

import pytest

from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from tests.worker.conftest import WorkerThread, generate
from worker_client.testing import ScriptedEngine, reference_output


def _prompts(count: int, seed: int, chunk_size: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Half shorter than a chunk, half spanning several chunks.
    lengths = [
        rng.randint(1, chunk_size - 1) if i % 2 else rng.randint(chunk_size + 1, 3 * chunk_size)
        for i in range(count)
    ]
    return [[rng.randrange(1, 1000) for _ in range(n)] for n in lengths]


def _run_concurrently(stub, prompts, max_new_tokens) -> dict[int, list[int]]:
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def one(index: int) -> None:
        try:
            results[index] = generate(stub, prompts[index], max_new_tokens)[1]
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


WORKER_MODES = pytest.mark.parametrize(
    "session, overlap", [(True, True), (False, False)], ids=["session-overlap", "unary-in-turn"]
)


@WORKER_MODES
@pytest.mark.parametrize("scheduler", [{"chunk_size": 32, "max_seq_len": 256}], indirect=True)
def test_sixteen_streams_on_two_workers_equal_sequential_generation(
    scheduler, stub, session, overlap
):
    # Both workers serve only if more than one worker's 8 slots are busy at once. With steps
    # that take no time, a loaded machine started the 16 stream threads so far apart that
    # w0 finished each before the next came and served all 16 alone; a step of 50 ms keeps
    # each sequence held for about 0.6 s (12 tokens), so the streams overlap. And both
    # register before the streams start.
    workers = [
        WorkerThread(
            scheduler.port,
            f"w{i}",
            ScriptedEngine(total_gdn_slots=8, step_seconds=0.05),
            session=session,
            overlap=overlap,
        ).start()
        for i in range(2)
    ]
    wait_until(
        lambda: len(stub.GetStatus(pb.GetStatusRequest()).workers) == 2,
        "both workers to register",
        30,
    )
    prompts = _prompts(16, seed=1, chunk_size=32)
    results = _run_concurrently(stub, prompts, max_new_tokens=12)
    for w in workers:
        w.stop.set()
        w.join()
    for i, prompt in enumerate(prompts):
        assert results[i] == reference_output(prompt, 12), f"stream {i}"
    assert all(w.loop.stats.finished > 0 for w in workers), "both workers should serve"
    for w in workers:
        assert w.engine.kv_free_pages() == w.engine.total_kv_pages
        assert w.engine.gdn_free_slots() == w.engine.total_gdn_slots


@pytest.mark.parametrize(
    "scheduler",
    [
        {"chunk_size": 16, "max_seq_len": 256, "prefill_reserve_pages": 1, "policy": policy}
        for policy in ("fifo", "budget")
    ],
    indirect=True,
    ids=["fifo", "budget"],
)
@WORKER_MODES
def test_preempted_sequences_resume_without_duplicate_tokens(scheduler, stub, session, overlap):
    # 12 pages of 4 tokens cannot hold 6 sequences of ~40 tokens: under fifo the engine
    # preempts; under budget the scheduler sees the pages run out and preempts first.
    engine = ScriptedEngine(total_kv_pages=12, page_size=4, total_gdn_slots=6)
    worker = WorkerThread(scheduler.port, "small", engine, session=session, overlap=overlap).start()
    prompts = _prompts(6, seed=2, chunk_size=16)
    prompts = [p[:20] for p in prompts]
    results = _run_concurrently(stub, prompts, max_new_tokens=10)
    worker.stop.set()
    worker.join()
    by_scheduler = sum(
        scheduler.registry.get_sample_value(
            "lattice_scheduler_preemptions_total", {"reason": reason}
        )
        or 0
        for reason in ("kv_growth", "no_progress")
    )
    assert worker.loop.stats.preempted + by_scheduler > 0, "the pool was meant to be too small"
    for i, prompt in enumerate(prompts):
        assert results[i] == reference_output(prompt, 10), f"stream {i}"
    assert engine.kv_free_pages() == engine.total_kv_pages


@pytest.mark.parametrize("scheduler", [{"chunk_size": 32, "max_seq_len": 512}], indirect=True)
def test_stopping_a_worker_mid_run_moves_its_sequences_to_the_other(scheduler, stub):
    slow = WorkerThread(scheduler.port, "leaving", ScriptedEngine(total_gdn_slots=16)).start()
    prompts = _prompts(8, seed=3, chunk_size=32)
    results: dict[int, list[int]] = {}
    runner = threading.Thread(
        target=lambda: results.update(_run_concurrently(stub, prompts, max_new_tokens=200))
    )
    runner.start()
    wait_until(
        lambda: slow.loop.stats.generated_tokens >= 20,
        "twenty tokens generated",
        10,
        every_seconds=0.01,
    )
    slow.stop.set()  # leaves with sequences half done: they go back to the queue
    slow.join()
    other = WorkerThread(scheduler.port, "staying", ScriptedEngine(total_gdn_slots=16)).start()
    runner.join(60)
    other.stop.set()
    other.join()
    assert slow.loop.stats.generated_tokens >= 20 and other.loop.stats.finished == 8
    for i, prompt in enumerate(prompts):
        assert results[i] == reference_output(prompt, 200), f"stream {i}"


@pytest.mark.parametrize("scheduler", [{"lease_ttl_ms": 200}], indirect=True)
def test_silent_worker_loses_its_sequences_after_the_lease_and_registers_again(scheduler, stub):
    engine = ScriptedEngine()
    worker = WorkerThread(scheduler.port, "sleepy", engine).start()
    seq_id = stub.Submit(pb.SubmitRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=4000)).seq_id
    wait_until(lambda: _state(stub, seq_id) == pb.SEQUENCE_STATE_DECODING, "decoding", 10)
    # Freeze the worker past its lease by holding up its next SelectBatch.
    gate = threading.Event()
    real_select = worker.client.select
    worker.client.select = lambda req: (gate.wait(), real_select(req))[1]
    wait_until(lambda: _state(stub, seq_id) == pb.SEQUENCE_STATE_QUEUED, "back in the queue", 5)
    gate.set()
    # Its next call is refused; the loop drops what it held, re-registers and re-admits.
    wait_until(lambda: worker.loop.stats.registrations == 2, "a second registration", 10)
    wait_until(lambda: _state(stub, seq_id) == pb.SEQUENCE_STATE_DECODING, "decoding again", 10)
    stub.Cancel(pb.CancelRequest(seq_id=seq_id))
    wait_until(lambda: not engine.running_ids(), "the engine to drop it", 10)
    worker.stop.set()
    worker.join()


@pytest.mark.parametrize("scheduler", [{"chunk_size": 32}], indirect=True)
def test_draining_worker_finishes_what_it_holds_and_takes_nothing_new(scheduler, stub):
    engine = ScriptedEngine(total_gdn_slots=4)
    worker = WorkerThread(scheduler.port, "drainer", engine, max_batch_size=2).start()
    # Long enough that the first two cannot finish (and two more be admitted) between
    # "two running" and the drain reaching the worker: a faster decision loop made that
    # window a race.
    ids = [
        stub.Submit(pb.SubmitRequest(prompt_token_ids=[i + 1] * 5, max_new_tokens=500)).seq_id
        for i in range(4)
    ]
    wait_until(lambda: len(engine.running_ids()) == 2, "two running", 10)
    worker.drain.set()
    worker.join()
    states = [stub.GetSequence(pb.GetSequenceRequest(seq_id=s)).state for s in ids]
    assert states.count(pb.SEQUENCE_STATE_FINISHED) == 2
    assert states.count(pb.SEQUENCE_STATE_QUEUED) == 2
    assert engine.gdn_free_slots() == engine.total_gdn_slots


def test_client_retries_until_the_scheduler_comes_up():
    import socket

    from worker_client.client import RetryPolicy, SchedulerClient, WorkerResources

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = SchedulerClient(
        f"127.0.0.1:{port}",
        call_timeout_seconds=0.5,
        retry=RetryPolicy(initial_seconds=0.05, total_seconds=15),
    )
    holder: dict = {}
    starter = threading.Timer(0.5, lambda: holder.setdefault("server", start_scheduler_on(port)))
    starter.start()
    try:
        settings = client.register(WorkerResources("late", 10, 16, 2))
        assert settings.chunk_size == 512
    finally:
        starter.join()
        client.close()
        holder["server"].stop(0)


def test_client_gives_up_with_a_clear_error_when_no_scheduler_answers():
    from worker_client.client import (
        RetryPolicy,
        SchedulerCallError,
        SchedulerClient,
        WorkerResources,
    )

    client = SchedulerClient(
        "127.0.0.1:1",
        call_timeout_seconds=0.2,
        retry=RetryPolicy(initial_seconds=0.05, total_seconds=0.5),
    )
    with pytest.raises(SchedulerCallError, match="RegisterWorker: UNAVAILABLE"):
        client.register(WorkerResources("nobody", 10, 16, 2))
    client.close()


def start_scheduler_on(port: int):
    from prometheus_client import CollectorRegistry

    from service.core import SchedulerConfig
    from service.server.app import start
    from service.settings import ServeSettings

    return start(
        ServeSettings(host="127.0.0.1", port=port, metrics_port=0, scheduler=SchedulerConfig()),
        CollectorRegistry(),
    )


def _state(stub, seq_id: int) -> int:
    return stub.GetSequence(pb.GetSequenceRequest(seq_id=seq_id)).state


@pytest.mark.parametrize(
    "session, overlap",
    [(False, False), (False, True), (True, False), (True, True)],
    ids=["unary", "unary-overlap", "session", "session-overlap"],
)
@pytest.mark.parametrize("scheduler", [{"chunk_size": 8, "max_seq_len": 256}], indirect=True)
def test_lost_answers_and_retried_reports_neither_duplicate_nor_lose_tokens(
    scheduler, stub, session, overlap
):
    """One SelectBatch in five (seeded) is applied by the scheduler but its answer never
    arrives: a unary call fails, or the session breaks after the answer was sent."""
    import grpc

    class LostAnswer(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.DEADLINE_EXCEEDED

        def details(self):
            return "answer lost (test)"

    engine = ScriptedEngine(total_gdn_slots=8)
    worker = WorkerThread(scheduler.port, "flaky", engine, session=session, overlap=overlap)
    client = worker.client
    rng = random.Random(5)
    calls = {"n": 0, "lost": 0}

    def losing(real):
        def call(request, timeout=None, **options):
            calls["n"] += 1
            answer = real(request, timeout=timeout, **options)
            if rng.random() < 0.2:
                calls["lost"] += 1
                client._end_session()  # a session does not survive a lost answer
                raise LostAnswer()
            return answer

        return call

    if session:
        client._exchange = losing(client._exchange)
    else:
        client._stub.SelectBatch = losing(client._stub.SelectBatch)
    client._retry = type(client._retry)(initial_seconds=0.001, total_seconds=5)
    worker.start()
    prompts = _prompts(8, seed=5, chunk_size=8)
    results = _run_concurrently(stub, prompts, max_new_tokens=20)
    worker.stop.set()
    worker.join()
    assert calls["lost"] >= 5, f"enough answers were lost to matter: {calls}"
    for i, prompt in enumerate(prompts):
        assert results[i] == reference_output(prompt, 20), f"stream {i}"


def test_client_channel_reconnects_no_slower_than_its_retry_backoff(monkeypatch):
    # gRPC's default reconnect backoff grows to 120 s: after a one-minute outage a worker
    # registered 10 s after the scheduler was back (1.5 s with the cap).
    import grpc as grpc_module

    from worker_client import client as client_module

    seen: dict = {}
    real_channel = grpc_module.insecure_channel

    def fake_channel(target, options=None):
        seen.update(options or [])
        return real_channel(target)

    monkeypatch.setattr(client_module.grpc, "insecure_channel", fake_channel)
    retry = client_module.RetryPolicy(initial_seconds=0.1, max_seconds=2.0)
    client_module.SchedulerClient("127.0.0.1:1", retry=retry).close()
    assert seen["grpc.initial_reconnect_backoff_ms"] == 100
    assert seen["grpc.max_reconnect_backoff_ms"] == 2000
