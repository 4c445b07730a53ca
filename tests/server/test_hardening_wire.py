"""Over the wire: worker incarnations, the cap on a worker's batch size, token offsets and
counts, and the reason a FAILED sequence carries (contract additions an outside
probe of the wire asked for)."""

from __future__ import annotations

import grpc
import pytest

from lattice.scheduler.v1 import scheduler_pb2 as pb

from .test_state_dir import Durable
from .wire import RPC_TIMEOUT_SECONDS, Stream, Worker, admitted, get_sequence, rpc_error, submit

UINT32_MAX = 2**32 - 1
VOCABULARY = "token id 600 is outside the model's vocabulary of 512"


def _select(stub, worker_id: str, incarnation: int, **fields) -> pb.SchedulerDecision:
    return stub.SelectBatch(
        pb.SelectBatchRequest(
            worker_id=worker_id,
            incarnation=incarnation,
            kv_free_pages=1000,
            gdn_free_slots=64,
            **fields,
        ),
        timeout=RPC_TIMEOUT_SECONDS,
    )


def _deregister(stub, worker_id: str, incarnation: int) -> pb.DeregisterWorkerResponse:
    return stub.DeregisterWorker(
        pb.DeregisterWorkerRequest(worker_id=worker_id, incarnation=incarnation),
        timeout=RPC_TIMEOUT_SECONDS,
    )


def _iteration(stub, worker_id: str) -> int:
    workers = stub.GetStatus(pb.GetStatusRequest(), timeout=RPC_TIMEOUT_SECONDS).workers
    return next(w.iteration for w in workers if w.worker_id == worker_id)


# ------------------------------------------------------------------------ incarnations


def test_register_worker_answers_an_incarnation_that_grows_with_every_registration(stub):
    numbers = [Worker(stub, w).register().incarnation for w in ("a", "b", "a", "a", "c")]
    assert numbers[0] >= 1
    assert all(later > earlier for earlier, later in zip(numbers, numbers[1:]))


def test_get_status_shows_each_workers_current_incarnation(stub):
    first = Worker(stub, "a").register().incarnation
    second = Worker(stub, "a").register().incarnation
    (worker,) = stub.GetStatus(pb.GetStatusRequest(), timeout=RPC_TIMEOUT_SECONDS).workers
    assert worker.incarnation == second != first


def test_select_batch_from_a_superseded_incarnation_fails_precondition_and_changes_nothing(stub):
    """Regression (outside probe): two processes with one worker_id fought over it (~100
    lost-requeues per 100 sequences; twice in 8 runs a sequence finished with wrong output)."""
    old = Worker(stub, "w1").register().incarnation
    seq_id = submit(stub).seq_id
    new = Worker(stub, "w1").register().incarnation
    assert admitted(_select(stub, "w1", new)) == [seq_id]
    before = get_sequence(stub, seq_id), _iteration(stub, "w1")

    err = rpc_error(
        lambda: _select(
            stub,
            "w1",
            old,
            running=[seq_id],
            tokens=[pb.TokenUpdate(seq_id=seq_id, token_ids=[5, 6], offset=0)],
            finished=[
                pb.FinishedSequence(seq_id=seq_id, reason=pb.FINISH_REASON_EOS, generated_tokens=2)
            ],
        )
    )
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert err.details().startswith(
        f"superseded: worker_id 'w1' incarnation {old} was replaced by incarnation {new}"
    )
    assert (get_sequence(stub, seq_id), _iteration(stub, "w1")) == before
    # The newer incarnation carries on undisturbed: its sequence was never lost.
    assert [c.seq_id for c in _select(stub, "w1", new, waiting=[seq_id]).prefill] == [seq_id]


def test_deregister_from_a_superseded_incarnation_fails_precondition_and_keeps_the_worker(stub):
    old = Worker(stub, "w1").register().incarnation
    new = Worker(stub, "w1").register().incarnation
    err = rpc_error(lambda: _deregister(stub, "w1", old))
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert err.details().startswith("superseded:")
    assert _iteration(stub, "w1") == 0  # still registered
    _deregister(stub, "w1", new)
    assert not stub.GetStatus(pb.GetStatusRequest(), timeout=RPC_TIMEOUT_SECONDS).workers


def test_incarnation_zero_means_the_latest_for_clients_that_do_not_send_it(stub, worker):
    worker.register()
    worker.register()
    seq_id = submit(stub).seq_id
    assert admitted(worker.select()) == [seq_id]
    assert worker.deregister().requeued == 1


def test_incarnations_are_never_reused_across_a_restart(tmp_path):
    server = Durable(tmp_path / "state")
    try:
        kept = Worker(server.stub, "kept").register().incarnation
        last = Worker(server.stub, "gone").register().incarnation
        _deregister(server.stub, "gone", last)
        stub = server.restart()
        # The recovered worker's process carries on with the number it has.
        _select(stub, "kept", kept)
        assert Worker(stub, "new").register().incarnation > last
    finally:
        server.stop()


# ------------------------------------------------------------------------ batch size cap


def test_registering_with_uint32_max_gets_max_worker_batch_size_1024(stub, worker):
    """Regression (outside probe): a registered max_batch_size of 2**32-1 took 60,000
    sequences in one call, holding the scheduler's lock 1.2-1.5 s."""
    assert worker.register(max_batch_size=UINT32_MAX).max_batch_size == 1024


@pytest.mark.parametrize(
    "server", [{"max_worker_batch_size": 8, "max_batch_size": 4}], indirect=True
)
def test_a_worker_gets_no_more_than_max_worker_batch_size_admissions(stub, worker):
    assert worker.register(max_batch_size=UINT32_MAX).max_batch_size == 8
    for _ in range(20):
        submit(stub)
    assert len(admitted(worker.select())) == 8


# ------------------------------------------------------------------------ offsets, counts


def test_a_token_update_with_an_offset_past_the_known_tokens_is_invalid_argument(stub, worker):
    """Regression (outside probe): offset 50 with 5 tokens known was appended at position 5."""
    worker.register()
    seq_id = submit(stub, max_new_tokens=100).seq_id
    worker.select()
    worker.select(running=[seq_id], tokens={seq_id: [1, 2, 3, 4, 5]})

    def gap():
        return stub.SelectBatch(
            pb.SelectBatchRequest(
                worker_id="w1",
                running=[seq_id],
                kv_free_pages=1000,
                gdn_free_slots=64,
                tokens=[pb.TokenUpdate(seq_id=seq_id, token_ids=[6], offset=50)],
            ),
            timeout=RPC_TIMEOUT_SECONDS,
        )

    err = rpc_error(gap)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"seq_id {seq_id} offset 50 is beyond the 5 tokens known" in err.details()
    assert get_sequence(stub, seq_id).generated_tokens == 5


@pytest.mark.parametrize("count", [7, UINT32_MAX])
def test_a_finish_counting_unreported_tokens_is_invalid_argument_naming_generated_tokens(
    stub, worker, count
):
    """Regression (outside probe): a finish counting 7 after 6 reported tokens was
    accepted (the stream had 6, GetSequence 7); 2**32-1 was capped."""
    worker.register()
    seq_id = submit(stub, max_new_tokens=8).seq_id
    worker.select()
    worker.select(running=[seq_id], tokens={seq_id: [1, 2, 3, 4, 5]})
    err = rpc_error(
        lambda: worker.select(
            finished=[(seq_id, pb.FINISH_REASON_EOS, count)], tokens={seq_id: [6]}
        )
    )
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "generated_tokens" in err.details() and "nothing was applied" in err.details()
    info = get_sequence(stub, seq_id)
    assert (info.generated_tokens, info.finish_reason) == (5, pb.FINISH_REASON_UNSPECIFIED)


# ------------------------------------------------------------------------ FAILED reasons


def test_a_failed_sequence_carries_the_workers_reason_to_get_sequence_and_generate(stub, worker):
    """Regression (outside probe): a prompt with an out-of-vocabulary id finished FAILED
    with no reason anywhere."""
    worker.register()
    stream = Stream(stub, pb.SubmitRequest(prompt_token_ids=[1, 600], max_new_tokens=4))
    seq_id = stream.next_event().seq_id
    assert admitted(worker.select()) == [seq_id]
    stub.SelectBatch(
        pb.SelectBatchRequest(
            worker_id="w1",
            kv_free_pages=1000,
            gdn_free_slots=64,
            finished=[
                pb.FinishedSequence(
                    seq_id=seq_id, reason=pb.FINISH_REASON_FAILED, error_message=VOCABULARY
                )
            ],
        ),
        timeout=RPC_TIMEOUT_SECONDS,
    )
    (last,) = stream.rest()
    assert last.finished and last.finish_reason == pb.FINISH_REASON_FAILED
    assert last.error_message == VOCABULARY
    info = get_sequence(stub, seq_id)
    assert (info.finish_reason, info.error_message) == (pb.FINISH_REASON_FAILED, VOCABULARY)


def test_a_sequence_that_did_not_fail_has_no_error_message(stub, worker):
    worker.register()
    seq_id = submit(stub).seq_id
    worker.select()
    stub.SelectBatch(
        pb.SelectBatchRequest(
            worker_id="w1",
            kv_free_pages=1000,
            gdn_free_slots=64,
            finished=[
                pb.FinishedSequence(
                    seq_id=seq_id, reason=pb.FINISH_REASON_EOS, error_message="not a failure"
                )
            ],
        ),
        timeout=RPC_TIMEOUT_SECONDS,
    )
    assert get_sequence(stub, seq_id).error_message == ""


def test_a_very_long_error_message_is_cut_not_refused(stub, worker):
    worker.register()
    seq_id = submit(stub).seq_id
    worker.select()
    stub.SelectBatch(
        pb.SelectBatchRequest(
            worker_id="w1",
            kv_free_pages=1000,
            gdn_free_slots=64,
            finished=[
                pb.FinishedSequence(
                    seq_id=seq_id, reason=pb.FINISH_REASON_FAILED, error_message="x" * 100_000
                )
            ],
        ),
        timeout=RPC_TIMEOUT_SECONDS,
    )
    message = get_sequence(stub, seq_id).error_message
    assert 0 < len(message) <= 1000 and message.endswith("(100000 chars)")
