"""The admin DrainWorker RPC against a real server on loopback.

An operator drain stops admissions to one worker; what it holds keeps prefilling,
decoding and finishing; `resume` lifts it. Auth (admin only) is in tests/security.
"""

from __future__ import annotations

import grpc

from lattice.scheduler.v1 import scheduler_pb2 as pb

from .wire import (
    RPC_TIMEOUT_SECONDS,
    Worker,
    admitted,
    continued,
    get_sequence,
    rpc_error,
    submit,
    submit_many,
)

EOS = pb.FINISH_REASON_EOS


def drain(stub, worker_id: str = "w1", resume: bool = False) -> int:
    return stub.DrainWorker(
        pb.DrainWorkerRequest(worker_id=worker_id, resume=resume), timeout=RPC_TIMEOUT_SECONDS
    ).num_assigned


def worker_status(stub, worker_id: str = "w1") -> pb.WorkerStatus:
    workers = stub.GetStatus(pb.GetStatusRequest(), timeout=RPC_TIMEOUT_SECONDS).workers
    return next(w for w in workers if w.worker_id == worker_id)


def test_drained_worker_admits_nothing_while_its_sequences_decode_and_finish(stub, worker):
    worker.register()
    prefilling, decoding = submit_many(stub, 2, prompt=range(1000))
    queued = submit(stub).seq_id
    assert admitted(worker.select(gdn_free_slots=2)) == [prefilling, decoding]

    assert drain(stub) == 2
    # The worker itself does not say it drains: the operator's drain holds anyway.
    decision = worker.select(waiting=[prefilling], running=[decoding])
    assert admitted(decision) == []
    assert continued(decision) == [prefilling] and list(decision.decode) == [decoding]
    assert get_sequence(stub, queued).state == pb.SEQUENCE_STATE_QUEUED

    decision = worker.select(running=[prefilling, decoding], tokens={decoding: [7]})
    assert admitted(decision) == [] and list(decision.decode) == [prefilling, decoding]
    worker.select(running=[prefilling], finished=[(decoding, EOS, 1)])
    finished = get_sequence(stub, decoding)
    assert (finished.state, finished.finish_reason) == (pb.SEQUENCE_STATE_FINISHED, EOS)
    assert get_sequence(stub, queued).state == pb.SEQUENCE_STATE_QUEUED
    assert worker_status(stub).num_assigned == 1


def test_resume_admits_again_and_answers_what_is_still_assigned(stub, worker):
    worker.register()
    running = submit(stub).seq_id
    assert admitted(worker.select(gdn_free_slots=1)) == [running]
    queued = submit(stub).seq_id
    assert drain(stub) == 1
    assert admitted(worker.select(running=[running])) == []

    assert drain(stub, resume=True) == 1
    assert admitted(worker.select(running=[running])) == [queued]


def test_drain_of_one_worker_leaves_the_queue_to_the_others(stub):
    w1, w2 = Worker(stub, "w1"), Worker(stub, "w2")
    w1.register()
    w2.register()
    seq_id = submit(stub).seq_id
    assert drain(stub, "w1") == 0
    assert admitted(w1.select()) == []
    assert admitted(w2.select()) == [seq_id]


def test_drain_of_an_unknown_worker_is_failed_precondition_naming_it(stub):
    for resume in (False, True):
        err = rpc_error(lambda resume=resume: drain(stub, "ghost", resume=resume))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "ghost" in err.details()


def test_status_shows_draining_from_the_drain_until_resume(stub, worker):
    worker.register()
    worker.select()
    assert worker_status(stub).draining is False
    drain(stub)
    assert worker_status(stub).draining is True  # before the worker calls again
    worker.select()
    assert worker_status(stub).draining is True
    drain(stub, resume=True)
    assert worker_status(stub).draining is False


def test_resume_lifts_only_the_operator_drain_not_the_workers_own(stub, worker):
    worker.register()
    submit(stub)
    drain(stub)
    worker.select(draining=True)
    drain(stub, resume=True)
    assert worker_status(stub).draining is True
    assert admitted(worker.select(draining=True)) == []


def test_a_new_registration_starts_undrained(stub, worker):
    worker.register()
    drain(stub)
    worker.register()
    seq_id = submit(stub).seq_id
    assert worker_status(stub).draining is False
    assert admitted(worker.select()) == [seq_id]


def test_drain_blocks_admissions_with_reason_draining_in_the_metrics(server, stub, worker):
    worker.register()
    submit(stub)
    drain(stub)
    worker.select()
    assert server.metric("admissions_blocked_total", reason="draining") == 1
