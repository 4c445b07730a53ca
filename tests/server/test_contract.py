"""The wire contract (shared/contract.md), pinned against a real server on loopback.

Each test name says which rule it pins. Small configs (chunk_size, max_queue,
lease_ttl_ms) are passed to the `server` fixture by indirect parametrization.
"""
from __future__ import annotations

import queue
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from lattice.scheduler.v1 import scheduler_pb2 as pb

from .wire import (
    RPC_TIMEOUT_SECONDS, Worker, admitted, continued, get_sequence, rpc_error, submit,
    submit_many, wait_until,
)

EOS = pb.FINISH_REASON_EOS
MAX_LENGTH = pb.FINISH_REASON_MAX_LENGTH
PREEMPTED = pb.FINISH_REASON_PREEMPTED
CANCELLED = pb.FINISH_REASON_CANCELLED
QUEUED = pb.SEQUENCE_STATE_QUEUED
PREFILLING = pb.SEQUENCE_STATE_PREFILLING
DECODING = pb.SEQUENCE_STATE_DECODING
FINISHED = pb.SEQUENCE_STATE_FINISHED


def config(**overrides):
    """Indirect parametrization of the `server` fixture with SchedulerConfig overrides."""
    return pytest.mark.parametrize("server", [overrides], indirect=True)


def queue_depth(stub) -> int:
    return stub.GetStatus(pb.GetStatusRequest(), timeout=RPC_TIMEOUT_SECONDS).queue_depth


# ===================================================================== RPCs


def test_submit_returns_increasing_seq_ids_and_queue_positions(stub):
    responses = [submit(stub) for _ in range(3)]
    assert [r.queue_position for r in responses] == [0, 1, 2]
    ids = [r.seq_id for r in responses]
    assert len(set(ids)) == 3 and ids == sorted(ids)
    assert all(get_sequence(stub, s).state == QUEUED for s in ids)


def test_queue_position_counts_only_sequences_still_queued(stub, worker):
    worker.register(max_batch_size=2)
    first = submit_many(stub, 3)
    assert admitted(worker.select()) == first[:2]
    assert get_sequence(stub, first[2]).queue_position == 0
    assert submit(stub).queue_position == 1
    stub.Cancel(pb.CancelRequest(seq_id=first[2]), timeout=RPC_TIMEOUT_SECONDS)
    assert submit(stub).queue_position == 1


def test_cancel_of_queued_sequence_finishes_it_cancelled_and_removes_it_from_queue(stub):
    seq_id, other = submit_many(stub, 2)
    assert stub.Cancel(pb.CancelRequest(seq_id=seq_id), timeout=RPC_TIMEOUT_SECONDS).cancelled
    info = get_sequence(stub, seq_id)
    assert (info.state, info.finish_reason) == (FINISHED, CANCELLED)
    assert queue_depth(stub) == 1
    assert get_sequence(stub, other).queue_position == 0


def test_cancel_of_finished_sequence_answers_cancelled_false(stub, worker):
    worker.register()
    seq_id = submit(stub).seq_id
    worker.select()
    worker.select(finished=[(seq_id, EOS, 1)])
    resp = stub.Cancel(pb.CancelRequest(seq_id=seq_id), timeout=RPC_TIMEOUT_SECONDS)
    assert resp.cancelled is False
    assert get_sequence(stub, seq_id).finish_reason == EOS


def test_register_worker_answers_the_scheduler_defaults(stub, worker):
    resp = worker.register(max_batch_size=0)
    assert (resp.chunk_size, resp.max_batch_size, resp.prefill_reserve_pages) == (512, 32, 8)
    assert resp.lease_ttl_ms > 0


@config(max_batch_size=3, chunk_size=7, prefill_reserve_pages=2, lease_ttl_ms=4321)
def test_register_worker_answers_configured_settings_and_its_own_max_batch_size(stub):
    default = Worker(stub, "a").register(max_batch_size=0)
    assert (default.chunk_size, default.max_batch_size, default.prefill_reserve_pages,
            default.lease_ttl_ms) == (7, 3, 2, 4321)
    assert Worker(stub, "b").register(max_batch_size=5).max_batch_size == 5


def test_select_batch_iteration_counts_from_one_per_registration(worker):
    worker.register()
    assert [worker.select().iteration for _ in range(3)] == [1, 2, 3]
    worker.register()
    assert worker.select().iteration == 1


def test_deregister_worker_requeues_at_head_and_forgets_the_worker(stub, worker):
    worker.register(max_batch_size=2)
    a, b, c = submit_many(stub, 3)
    worker.select()
    assert worker.deregister().requeued == 2
    assert [get_sequence(stub, s).queue_position for s in (a, b, c)] == [0, 1, 2]
    assert all(get_sequence(stub, s).state == QUEUED for s in (a, b))
    err = rpc_error(lambda: worker.select())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_get_status_reports_queue_workers_and_policy(stub, worker):
    worker.register(total_kv_pages=100, total_gdn_slots=9)
    submit_many(stub, 2)
    worker.select(kv_free_pages=77, gdn_free_slots=5, draining=True)
    st = stub.GetStatus(pb.GetStatusRequest(), timeout=RPC_TIMEOUT_SECONDS)
    assert (st.queue_depth, st.num_assigned, st.policy) == (2, 0, "fifo")
    (w,) = st.workers
    assert (w.worker_id, w.kv_free_pages, w.gdn_free_slots, w.total_kv_pages,
            w.total_gdn_slots, w.iteration, w.draining) == ("w1", 77, 5, 100, 9, 1, True)


# ===================================================================== errors


@pytest.mark.parametrize("prompt, max_new_tokens, field_names", [
    ((), 4, ("prompt_token_ids",)),
    ((1, 2, 3), 0, ("max_new_tokens",)),
    ((1,) * 10, 7, ("max_seq_len=16", "17")),
])
@config(max_seq_len=16, chunk_size=8)
def test_submit_invalid_argument_names_the_field_and_limit(stub, prompt, max_new_tokens,
                                                           field_names):
    err = rpc_error(lambda: submit(stub, prompt=prompt, max_new_tokens=max_new_tokens))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    for name in field_names:
        assert name in err.details()
    assert queue_depth(stub) == 0


@config(max_seq_len=16, chunk_size=8)
def test_submit_of_exactly_max_seq_len_is_accepted(stub):
    assert submit(stub, prompt=(1,) * 10, max_new_tokens=6).seq_id > 0


@config(max_seq_len=16, chunk_size=8)
def test_generate_rejects_invalid_submit_with_invalid_argument(stub):
    call = stub.Generate(pb.SubmitRequest(prompt_token_ids=[], max_new_tokens=4),
                         timeout=RPC_TIMEOUT_SECONDS)
    err = rpc_error(lambda: list(call))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_token_ids" in err.details()


@config(max_queue=2)
def test_submit_beyond_max_queue_is_resource_exhausted_naming_the_limit(stub, worker):
    submit_many(stub, 2)
    err = rpc_error(lambda: submit(stub))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queue=2" in err.details()
    # Admission frees room again.
    worker.register(max_batch_size=1)
    worker.select()
    assert submit(stub).queue_position == 1


@config(max_queue=1)
def test_submit_repeating_request_id_is_ok_even_with_a_full_queue(stub):
    first = submit(stub, request_id="req-1")
    again = submit(stub, request_id="req-1")
    assert again.seq_id == first.seq_id
    assert queue_depth(stub) == 1


def test_submit_repeating_request_id_returns_first_seq_id_and_enqueues_once(stub):
    first = submit(stub, request_id="r")
    other = submit(stub, request_id="s")
    again = submit(stub, request_id="r", prompt=(9, 9), max_new_tokens=1)
    assert again.seq_id == first.seq_id != other.seq_id
    assert queue_depth(stub) == 2
    assert get_sequence(stub, first.seq_id).prompt_len == 3


def test_submit_with_empty_request_id_is_never_deduplicated(stub):
    a, b = submit_many(stub, 2, request_id="")
    assert a != b and queue_depth(stub) == 2


@pytest.mark.parametrize("rpc", ["Cancel", "GetSequence"])
def test_unknown_seq_id_is_not_found_naming_the_id(stub, rpc):
    request = pb.CancelRequest(seq_id=424242) if rpc == "Cancel" \
        else pb.GetSequenceRequest(seq_id=424242)
    err = rpc_error(lambda: getattr(stub, rpc)(request, timeout=RPC_TIMEOUT_SECONDS))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "424242" in err.details()


def test_select_batch_from_unregistered_worker_is_failed_precondition(stub):
    err = rpc_error(lambda: Worker(stub, "ghost").select())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "ghost" in err.details() and "RegisterWorker" in err.details()


@pytest.mark.parametrize("waiting_of, running_of", [
    ([0, 0], []),
    ([], [0, 0]),
    ([0], [0]),
])
def test_id_twice_in_waiting_running_is_invalid_argument_and_changes_nothing(
        stub, worker, waiting_of, running_of):
    worker.register()
    ids = submit_many(stub, 2)
    worker.select()
    err = rpc_error(lambda: worker.select(waiting=[ids[i] for i in waiting_of],
                                          running=[ids[i] for i in running_of]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(ids[0]) in err.details() and "waiting/running" in err.details()
    # The rejected report was not applied: nothing counted as lost, nothing requeued.
    assert [get_sequence(stub, s).state for s in ids] == [PREFILLING, PREFILLING]
    assert queue_depth(stub) == 0


@pytest.mark.parametrize("worker_id, page_size, field_name", [
    ("", 16, "worker_id"),
    ("w1", 0, "page_size"),
])
def test_register_worker_invalid_argument_names_the_field(stub, worker_id, page_size,
                                                           field_name):
    err = rpc_error(lambda: Worker(stub, worker_id).register(page_size=page_size))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_name in err.details()
