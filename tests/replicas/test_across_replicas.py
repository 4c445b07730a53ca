"""Two in-process replicas on one database: what one replica does, the other sees."""

from __future__ import annotations

import time

import grpc
import pytest

from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from tests.server.wire import (
    RPC_TIMEOUT_SECONDS,
    Stream,
    Worker,
    admit_until,
    admitted,
    get_sequence,
    submit,
)
from worker_client.client import NotRegistered, RetryPolicy, SchedulerClient, WorkerResources

from .conftest import count_reads, crash

EOS = pb.FINISH_REASON_EOS
CANCELLED = pb.FINISH_REASON_CANCELLED


def _first_token_waits(streaming, worker: Worker, count: int) -> list[float]:
    """`count` times: a stream on replica `streaming` of a new sequence, which `worker`
    (of another replica) is given and runs a token of once the stream has read it
    unclaimed; how long from then until the stream had that token."""
    waits = []
    for n in range(count):
        stream = Stream(
            streaming.stub, pb.SubmitRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=2)
        )
        seq_id = stream.next_event().seq_id
        time.sleep(0.05)  # its first read has found it unclaimed
        started = time.monotonic()
        wait_until(
            lambda seq_id=seq_id: admitted(worker.select()) == [seq_id],
            "admission",
            10,
            every_seconds=0.005,
        )
        worker.select(running=[seq_id], tokens={seq_id: [40 + n]})
        assert stream.tokens_until(1, 10) == [40 + n]
        waits.append(time.monotonic() - started)
        worker.select(tokens={seq_id: [50]}, finished=[(seq_id, EOS, 2)])
        stream.rest(10)
    return waits


def _unclaimable_streams(server, count: int, timeout_seconds: float) -> list[Stream]:
    """`count` streams on `server` of sequences no worker can run (an adapter nobody
    has), each past its first event (the submit)."""
    streams = [
        Stream(
            server.stub,
            pb.SubmitRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=2, adapter_id="none"),
            timeout_seconds=timeout_seconds,
        )
        for _ in range(count)
    ]
    for stream in streams:
        stream.next_event()
    return streams


def _core(server):
    return server.running._serving.servicer._core


def test_generate_on_one_replica_streams_tokens_a_worker_reports_to_the_other(start_replicas):
    r0, r1 = start_replicas(2)
    worker = Worker(r0.stub, "w")
    worker.register()
    stream = Stream(r1.stub, pb.SubmitRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=3))
    seq_id = stream.next_event().seq_id
    wait_until(lambda: admitted(worker.select()) == [seq_id], "admission on r0", 10)
    worker.select(running=[seq_id], tokens={seq_id: [7, 8]})
    assert stream.tokens_until(2, 10) == [7, 8]
    info = get_sequence(r1.stub, seq_id)
    assert (info.state, info.worker_id, info.generated_tokens) == (
        pb.SEQUENCE_STATE_DECODING,
        "w",
        2,
    )
    worker.select(tokens={seq_id: [9]}, finished=[(seq_id, EOS, 3)])
    events = stream.rest(10)
    assert [t for e in events for t in e.token_ids] == [9]
    assert events[-1].finished and events[-1].finish_reason == EOS


def test_submit_on_either_replica_is_idempotent_by_request_id(start_replicas):
    r0, r1 = start_replicas(2)
    first = submit(r0.stub, request_id="same")
    again = submit(r1.stub, request_id="same")
    assert again.seq_id == first.seq_id
    status = r1.stub.GetStatus(pb.GetStatusRequest(), timeout=RPC_TIMEOUT_SECONDS)
    assert status.queue_depth == 1


def test_cancel_on_another_replica_reaches_the_owner_and_its_worker_evicts(start_replicas):
    r0, r1 = start_replicas(2)
    worker = Worker(r0.stub, "w")
    worker.register()
    seq_id = submit(r1.stub).seq_id
    wait_until(lambda: admitted(worker.select()) == [seq_id], "admission on r0", 10)
    response = r1.stub.Cancel(pb.CancelRequest(seq_id=seq_id), timeout=RPC_TIMEOUT_SECONDS)
    assert response.cancelled
    wait_until(
        lambda: seq_id in worker.select(running=[seq_id]).evict,
        "the owner to evict the cancelled sequence",
        10,
    )
    info = get_sequence(r1.stub, seq_id)
    assert (info.state, info.finish_reason) == (pb.SEQUENCE_STATE_FINISHED, CANCELLED)


def test_a_worker_moving_on_unavailable_keeps_its_sequences_on_the_next_replica(start_replicas):
    r0, r1 = start_replicas(2)
    client = SchedulerClient(
        f"{r0.target},{r1.target}", call_timeout_seconds=2.0, retry=RetryPolicy(0.05, 0.2, 20.0)
    )
    resources = WorkerResources("w", 1000, 16, 64)
    client.register(resources)
    seq_id = submit(r0.stub, max_new_tokens=8).seq_id

    def report(**fields):
        return pb.SelectBatchRequest(worker_id="w", kv_free_pages=1000, gdn_free_slots=64, **fields)

    wait_until(
        lambda: [c.seq_id for c in client.select(report()).prefill] == [seq_id],
        "admission on r0",
        10,
    )
    client.select(
        report(running=[seq_id], tokens=[pb.TokenUpdate(seq_id=seq_id, token_ids=[5], offset=0)])
    )
    crash(r0)
    with pytest.raises(NotRegistered):  # r1 does not know the worker yet
        client.select(report(running=[seq_id]))
    assert client.target == r1.target and client.num_moves == 1
    client.register(resources)  # r1 adopts what the worker holds, at once
    decision = client.select(
        report(running=[seq_id], tokens=[pb.TokenUpdate(seq_id=seq_id, token_ids=[6], offset=1)])
    )
    assert list(decision.decode) == [seq_id] and not decision.evict
    info = get_sequence(r1.stub, seq_id)
    assert (info.worker_id, info.generated_tokens) == ("w", 2)
    client.close()


def test_claims_of_a_crashed_replica_return_after_its_lease_and_run_elsewhere(start_replicas):
    r0, r1 = start_replicas(2, replica_lease_ms=600)
    w0 = Worker(r0.stub, "w0")
    w0.register(max_batch_size=1)
    first, second = submit(r0.stub).seq_id, submit(r0.stub).seq_id
    wait_until(lambda: admitted(w0.select()) == [first], "admission on r0", 10)
    wait_until(lambda: _core(r0).num_queued() == 1, "r0 to prefetch the second", 10)
    crash(r0)
    w1 = Worker(r1.stub, "w1")
    w1.register(max_batch_size=4)
    got = admit_until(w1, 2)
    assert sorted(got) == [first, second]
    # The one that was running went to the head of the shared queue.
    assert got[0] == first


def test_a_replica_without_the_database_answers_unavailable_and_acknowledges_nothing(
    start_replicas, pg_cluster
):
    (r0,) = start_replicas(1)
    pg_cluster.stop()
    try:
        with pytest.raises(grpc.RpcError) as raised:
            submit(r0.stub, request_id="during-outage")
        assert raised.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        pg_cluster.start()
    # Back: the same request_id is new (nothing was committed), and the service works.
    wait_until(lambda: _submits(r0.stub, "after-outage"), "submits to work again", 30)
    seq_id = submit(r0.stub, request_id="during-outage").seq_id
    assert get_sequence(r0.stub, seq_id).state == pb.SEQUENCE_STATE_QUEUED


def _submits(stub, request_id: str) -> bool:
    try:
        submit(stub, request_id=request_id)
    except grpc.RpcError:
        return False
    return True


def test_claims_a_replica_can_no_longer_run_go_back_to_the_shared_queue(start_replicas):
    r0, r1 = start_replicas(2, replica_lease_ms=900)
    w0 = Worker(r0.stub, "w0")
    w0.register(max_batch_size=1)
    ids = [submit(r0.stub).seq_id for _ in range(3)]
    wait_until(lambda: _core(r0).num_queued() == 3, "r0 to claim all three", 10)
    w0.deregister()  # r0 has no worker left: its claims must not wait there
    w1 = Worker(r1.stub, "w1")
    w1.register(max_batch_size=4)
    got = admit_until(w1, 3)
    assert got == ids  # in their order


def test_a_replica_sheds_sheddable_requests_its_workers_could_not_start_in_time(start_replicas):
    # The cautious default step model prefills a few thousand tokens a second: a queue of
    # 1,000-token prompts outgrows a 1.5 s TTFT target within a few dozen of them.
    (r0,) = start_replicas(1, policy="budget", tpot_target_ms=100.0, ttft_target_ms=1500.0)
    prompt = [1] * 1000
    # No worker on this replica yet: it cannot tell when the fleet would start one.
    for _ in range(3):
        submit(r0.stub, prompt=prompt, priority=-1)
    Worker(r0.stub, "w").register()
    with pytest.raises(grpc.RpcError) as refused:
        for _ in range(60):
            submit(r0.stub, prompt=prompt, priority=-1)
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "shed: priority -1 is sheddable" in refused.value.details()
    # Priority 0 is never shed: it queues, late.
    submit(r0.stub, prompt=prompt, priority=0)


def test_the_watched_unclaimed_sequences_go_round_in_turns():
    from service.replicas.servicer import _unclaimed_window

    assert _unclaimed_window([9, 3, 5], 0, 4) == [3, 5, 9]  # all fit
    ids = list(range(1, 11))
    assert _unclaimed_window(ids, 0, 4) == [1, 2, 3, 4]
    assert _unclaimed_window(ids, 4, 4) == [5, 6, 7, 8]
    assert _unclaimed_window(ids, 8, 4) == [9, 10, 1, 2]  # wraps round
    assert _unclaimed_window(ids, 2, 4) == [3, 4, 5, 6]


def test_the_replicas_whose_commit_number_moved_or_that_left():
    from service.replicas.servicer import _moved

    assert _moved(None, {1: 5}) is None  # a first reading: anything may have moved
    assert _moved({1: 5, 2: 7}, {1: 5, 2: 7}) == frozenset()
    assert _moved({1: 5, 2: 7}, {1: 6, 2: 7}) == {1}
    assert _moved({1: 5, 2: 7}, {2: 7, 3: 1}) == {1, 3}  # 1 left (its lease ran out), 3 came


def test_a_submit_that_commits_after_a_newer_one_is_still_seen():
    from service.replicas.servicer import _GAP_SECONDS, _Submits
    from service.state.postgres import Watched

    submits = _Submits()
    assert submits.update(Watched({}, 10, ()), now=0.0)  # the first: anything may have
    assert not submits.update(Watched({}, 10, ()), now=0.1)
    # 12 is the newest now; 11 (handed out before it) may not have committed yet.
    assert submits.update(Watched({}, 12, ()), now=0.2)
    assert submits.after == 12 and set(submits.pending) == {11}
    assert not submits.update(Watched({}, 12, ()), now=0.3)
    assert submits.update(Watched({}, 12, (11,)), now=0.4)  # 11 is there now
    assert submits.pending == {}
    # The newest rows deleted (forgotten): nothing moves back.
    assert not submits.update(Watched({}, 9, ()), now=0.5) and submits.after == 12
    # One that never commits (a conflict took its id) is given up after _GAP_SECONDS.
    submits.update(Watched({}, 14, ()), now=1.0)
    assert set(submits.pending) == {13}
    submits.update(Watched({}, 14, ()), now=1.0 + _GAP_SECONDS + 0.01)
    assert submits.pending == {}


def test_a_submit_on_one_replica_reaches_the_other_without_a_notification(start_replicas):
    # No submit notifies (a NOTIFY wakes every replica's listener): r0's watcher finds it.
    # Without that, r0's prefetcher would find each within its half-second poll: a
    # median near 0.25 s over 20 submits.
    r0, r1 = start_replicas(2)
    worker = Worker(r0.stub, "w")
    worker.register()
    waits = []
    for _ in range(20):
        started = time.monotonic()
        seq_id = submit(r1.stub).seq_id

        def taken(seq_id: int = seq_id) -> bool:
            return admitted(worker.select()) == [seq_id]

        wait_until(taken, "admission on r0", 10, every_seconds=0.005)
        waits.append(time.monotonic() - started)
        worker.select(tokens={seq_id: [7]}, finished=[(seq_id, EOS, 1)])
    assert sorted(waits)[len(waits) // 2] < 0.15, waits


def test_busy_workers_do_not_put_off_the_prefetchers_claim_every_half_second(
    start_replicas, monkeypatch
):
    # With every hint of the submit lost (the watcher's here), the prefetcher still
    # claims every half second, though a worker calling every 5 ms wakes it far more
    # often (each call that leaves room does).
    from service.replicas import servicer as replica_servicer

    monkeypatch.setattr(replica_servicer._Submits, "update", lambda self, watched, now: False)
    r0, r1 = start_replicas(2)
    worker = Worker(r0.stub, "w")
    worker.register()
    time.sleep(1.25)  # past the first claims, and not in step with a half-second timer
    seq_id = submit(r1.stub).seq_id
    wait_until(
        lambda: admitted(worker.select()) == [seq_id], "admission on r0", 3, every_seconds=0.005
    )


def test_a_stream_on_the_replica_that_claims_its_sequence_gets_its_first_token_at_once(
    start_replicas,
):
    # Generate's first read can come before this replica's own claim lands: it waits as
    # if another replica ran the sequence, and this replica's commits wake no watcher.
    # The claim wakes it, so the first token does not wait for the one-second poll.
    (r0,) = start_replicas(1)
    worker = Worker(r0.stub, "w")
    worker.register()
    waits = []
    for n in range(6):
        stream = Stream(r0.stub, pb.SubmitRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=2))
        seq_id = stream.next_event().seq_id
        wait_until(
            lambda seq_id=seq_id: admitted(worker.select()) == [seq_id],
            "admission",
            10,
            every_seconds=0.005,
        )
        started = time.monotonic()
        worker.select(running=[seq_id], tokens={seq_id: [40 + n]})
        assert stream.tokens_until(1, 10) == [40 + n]
        waits.append(time.monotonic() - started)
        worker.select(tokens={seq_id: [50]}, finished=[(seq_id, EOS, 2)])
        stream.rest(10)
    assert max(waits) < 0.5, waits


def test_a_stream_of_a_sequence_another_replica_claims_gets_its_first_token_at_once(
    start_replicas,
):
    # The stream on r1 reads its sequence unclaimed and waits; r0 claims it, admits it and
    # commits its first token at once. A claim notifies no one and an unclaimed stream
    # does not follow commit numbers: r1's watcher finds the claim in its reading of the
    # ids such streams wait on, so the token does not wait for the one-second poll.
    r0, r1 = start_replicas(2)
    worker = Worker(r0.stub, "w")
    worker.register()
    waits = _first_token_waits(r1, worker, 6)
    assert max(waits) < 0.5, waits


def test_the_watcher_reads_nothing_while_nobody_needs_it_and_resumes_when_needed(
    start_replicas,
):
    # r1 has no worker (nothing to claim for) and no stream of another replica's sequence:
    # its prefetcher's hint that the shared queue may hold work stays set, so a reading
    # of submits or commit numbers would tell it nothing; the watcher skips them (before,
    # it read every 20 ms). Once a worker of r1 takes work and a claim comes back short,
    # the watcher reads again, and a submit on r0 (no submit notifies) reaches r1's worker.
    r0, r1 = start_replicas(2)
    state = r1.running._serving.servicer._state
    time.sleep(0.2)  # the first reading, which always happens
    before = state.round_trips["watch"]
    time.sleep(0.5)
    assert state.round_trips["watch"] - before <= 1
    worker = Worker(r1.stub, "w")
    worker.register()
    worker.select()  # a short claim: the shared queue holds nothing now
    time.sleep(0.1)
    before = state.round_trips["watch"]
    time.sleep(0.5)
    assert state.round_trips["watch"] - before >= 5
    seq_id = submit(r0.stub, max_new_tokens=2).seq_id
    wait_until(lambda: admitted(worker.select()) == [seq_id], "admission on r1", 10)


def test_an_idle_replica_whose_claims_are_slow_claims_no_more_than_its_half_second(
    start_replicas,
):
    # r1 has one idle worker and the shared queue holds nothing it can run; its claims
    # take 10 ms (a loaded database), twice its watch interval. While a claim that a
    # submit started runs, the hint stays set, so the watcher skips; a first build
    # counted the reading after a skip as a submit, which set the hint and started
    # another claim: 130 claims in 2 s. Now only the prefetcher's half-second claims
    # remain.
    r0, r1 = start_replicas(2)
    servicer = r1.running._serving.servicer
    servicer._watch_seconds = 0.005
    worker = Worker(r1.stub, "w")
    worker.register()
    worker.select()
    time.sleep(0.5)
    state = servicer._state
    claim, claims = state.claim, []

    def slow_claim(*args, **kwargs):
        claims.append(time.monotonic())
        time.sleep(0.01)
        return claim(*args, **kwargs)

    state.claim = slow_claim
    try:
        # A submit no worker can run: r1's watcher sees it, its prefetcher claims (the
        # hint set), and the claim comes back short.
        submit(r0.stub, adapter_id="none")
        time.sleep(2.0)
    finally:
        state.claim = claim
    assert len(claims) <= 6, len(claims)


def test_streams_past_the_watched_ones_are_not_held_by_sequences_nobody_claims(
    start_replicas,
):
    # 64 streams on r1 wait on sequences no worker can run (an adapter nobody has): they
    # fill a reading's lookup of unclaimed sequences. The lookup goes round in turns, so
    # a newer stream's sequence, claimed and started on r0, gets its first token within
    # a few readings, not at the 1 s poll (0.85-0.95 s in 4 of 6 with the oldest 64).
    r0, r1 = start_replicas(2)
    stuck = _unclaimable_streams(r1, 64, timeout_seconds=60)
    worker = Worker(r0.stub, "w")
    worker.register()
    waits = _first_token_waits(r1, worker, 6)
    for stream in stuck:
        stream.call.cancel()
    assert max(waits) < 0.5, waits


def test_streams_of_unclaimed_sequences_do_not_read_again_at_every_commit_elsewhere(
    start_replicas,
):
    # 40 streams on r1 of sequences no replica can claim (an adapter no worker has) while
    # r0 commits a steady step every ~10 ms: they follow the watcher's reading of their
    # claims and the one-second poll, not every commit number that moves (about 2 reads a stream a
    # second, against several a commit before).
    r0, r1 = start_replicas(2)
    plain = Worker(r0.stub, "plain")
    plain.register()
    base = submit(r0.stub, max_new_tokens=4000).seq_id
    wait_until(lambda: admitted(plain.select()) == [base], "admission on r0", 10)
    streams = _unclaimable_streams(r1, 40, timeout_seconds=30)
    reads = count_reads(r1)
    time.sleep(0.5)
    reads[0] = 0
    started = time.monotonic()
    while time.monotonic() - started < 2.0:
        plain.select(running=[base], tokens={base: [5]})  # a steady commit on r0
        time.sleep(0.01)
    for stream in streams:
        stream.call.cancel()
    # About 2 reads a stream a second, poll and wake-ups: 162-226 in all here on an idle
    # machine, 242 under a CI run's load; every commit's wake-up read 3,612 times.
    assert reads[0] < 40 * 2 * 2 * 3, reads[0]
