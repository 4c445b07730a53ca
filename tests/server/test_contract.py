"""The wire contract (docs/contract.md), pinned against a real server on loopback.

Every test runs twice: fake workers report by unary SelectBatch calls, then over
WorkerSession streams (same meaning, one decision per request, in order); a
FAILED_PRECONDITION or INVALID_ARGUMENT then ends the session, and the next report opens
a new one. Each test name says which rule it pins. Small configs (chunk_size, max_queue,
lease_ttl_ms) are passed to the `server` fixture by indirect parametrization.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb

from .wire import (
    RPC_TIMEOUT_SECONDS,
    TRANSPORTS,
    Stream,
    Worker,
    admitted,
    continued,
    get_sequence,
    rpc_error,
    submit,
    submit_many,
)

EOS = pb.FINISH_REASON_EOS
MAX_LENGTH = pb.FINISH_REASON_MAX_LENGTH
PREEMPTED = pb.FINISH_REASON_PREEMPTED
CANCELLED = pb.FINISH_REASON_CANCELLED
QUEUED = pb.SEQUENCE_STATE_QUEUED
PREFILLING = pb.SEQUENCE_STATE_PREFILLING
DECODING = pb.SEQUENCE_STATE_DECODING
FINISHED = pb.SEQUENCE_STATE_FINISHED


@pytest.fixture(params=TRANSPORTS)
def transport(request) -> str:
    return request.param


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
    worker.select(finished=[(seq_id, EOS, 0)])
    resp = stub.Cancel(pb.CancelRequest(seq_id=seq_id), timeout=RPC_TIMEOUT_SECONDS)
    assert resp.cancelled is False
    assert get_sequence(stub, seq_id).finish_reason == EOS


def test_register_worker_answers_the_scheduler_defaults(stub, worker):
    resp = worker.register(max_batch_size=0)
    assert (resp.chunk_size, resp.max_batch_size, resp.prefill_reserve_pages) == (512, 32, 8)
    assert resp.lease_ttl_ms > 0


@config(max_batch_size=3, chunk_size=7, prefill_reserve_pages=2, lease_ttl_ms=4321)
def test_register_worker_answers_configured_settings_and_its_own_max_batch_size(stub, make_worker):
    default = make_worker("a").register(max_batch_size=0)
    assert (
        default.chunk_size,
        default.max_batch_size,
        default.prefill_reserve_pages,
        default.lease_ttl_ms,
    ) == (7, 3, 2, 4321)
    assert make_worker("b").register(max_batch_size=5).max_batch_size == 5


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
    assert (
        w.worker_id,
        w.kv_free_pages,
        w.gdn_free_slots,
        w.total_kv_pages,
        w.total_gdn_slots,
        w.iteration,
        w.draining,
    ) == ("w1", 77, 5, 100, 9, 1, True)


# ===================================================================== errors


@pytest.mark.parametrize(
    "prompt, max_new_tokens, field_names",
    [
        ((), 4, ("prompt_token_ids",)),
        ((1, 2, 3), 0, ("max_new_tokens",)),
        ((1,) * 10, 7, ("max_seq_len=16", "17")),
    ],
)
@config(max_seq_len=16, chunk_size=8)
def test_submit_invalid_argument_names_the_field_and_limit(
    stub, prompt, max_new_tokens, field_names
):
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
    call = stub.Generate(
        pb.SubmitRequest(prompt_token_ids=[], max_new_tokens=4), timeout=RPC_TIMEOUT_SECONDS
    )
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
    request = (
        pb.CancelRequest(seq_id=424242) if rpc == "Cancel" else pb.GetSequenceRequest(seq_id=424242)
    )
    err = rpc_error(lambda: getattr(stub, rpc)(request, timeout=RPC_TIMEOUT_SECONDS))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "424242" in err.details()


def test_select_batch_from_unregistered_worker_is_failed_precondition(stub, make_worker):
    err = rpc_error(lambda: make_worker("ghost").select())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "ghost" in err.details() and "RegisterWorker" in err.details()


@pytest.mark.parametrize(
    "waiting_of, running_of",
    [
        ([0, 0], []),
        ([], [0, 0]),
        ([0], [0]),
    ],
)
def test_id_twice_in_waiting_running_is_invalid_argument_and_changes_nothing(
    stub, worker, waiting_of, running_of
):
    worker.register()
    ids = submit_many(stub, 2)
    worker.select()
    err = rpc_error(
        lambda: worker.select(
            waiting=[ids[i] for i in waiting_of], running=[ids[i] for i in running_of]
        )
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(ids[0]) in err.details() and "waiting/running" in err.details()
    # The rejected report was not applied: nothing counted as lost, nothing requeued.
    assert [get_sequence(stub, s).state for s in ids] == [PREFILLING, PREFILLING]
    assert queue_depth(stub) == 0


@pytest.mark.parametrize(
    "worker_id, page_size, field_name",
    [
        ("", 16, "worker_id"),
        ("w1", 0, "page_size"),
    ],
)
def test_register_worker_invalid_argument_names_the_field(
    stub, make_worker, worker_id, page_size, field_name
):
    err = rpc_error(lambda: make_worker(worker_id).register(page_size=page_size))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_name in err.details()


# ===================================================================== fifo rules 1-7


@config(chunk_size=4)
def test_admission_chunk_is_zero_to_chunk_size_with_the_full_spec(stub, worker):
    worker.register()
    long_id = submit(
        stub,
        prompt=range(1, 11),
        max_new_tokens=5,
        adapter_id="",
        stop_token_ids=[7, 8],
        sampling=pb.SamplingParams(temperature=0.5, top_p=0.9, top_k=40, seed=1234),
    ).seq_id
    short_id = submit(stub, prompt=(5, 6), max_new_tokens=2).seq_id
    long_chunk, short_chunk = worker.select().prefill
    assert (long_chunk.seq_id, long_chunk.chunk_start, long_chunk.chunk_len) == (long_id, 0, 4)
    assert (short_chunk.seq_id, short_chunk.chunk_start, short_chunk.chunk_len) == (short_id, 0, 2)
    spec = long_chunk.spec
    assert list(spec.prompt_token_ids) == list(range(1, 11))
    assert spec.max_new_tokens == 5 and spec.adapter_id == ""
    assert list(spec.stop_token_ids) == [7, 8]
    assert (spec.sampling.top_k, spec.sampling.seed) == (40, 1234)
    assert spec.sampling.temperature == pytest.approx(0.5)
    assert spec.sampling.top_p == pytest.approx(0.9)


def test_rule1_finished_sequences_end_and_are_not_readmitted(stub, worker):
    worker.register(max_batch_size=1)
    a, b = submit_many(stub, 2)
    assert admitted(worker.select()) == [a]
    decision = worker.select(finished=[(a, EOS, 0)])
    info = get_sequence(stub, a)
    assert (info.state, info.finish_reason, info.worker_id) == (FINISHED, EOS, "")
    assert admitted(decision) == [b]
    assert a not in decision.decode and a not in decision.evict


def test_rule1_preempted_go_back_to_head_in_given_order(stub, worker):
    worker.register(max_batch_size=3)
    s1, s2, s3, s4, s5 = submit_many(stub, 5)
    assert admitted(worker.select()) == [s1, s2, s3]
    worker.select(running=[s2], preempted=[s3, s1], draining=True)
    assert [get_sequence(stub, s).queue_position for s in (s3, s1, s4, s5)] == [0, 1, 2, 3]
    assert get_sequence(stub, s3).state == QUEUED


@config(chunk_size=2)
def test_rule1_preempted_are_readmitted_first_from_token_zero_with_a_spec(stub, worker):
    worker.register(max_batch_size=3)
    s1, s2, s3, s4 = submit_many(stub, 4, prompt=(1, 2, 3))
    worker.select()
    worker.select(waiting=[s1, s2, s3])  # every cursor now at 2
    decision = worker.select(running=[s2], preempted=[s3, s1])
    assert admitted(decision) == [s3, s1]
    assert [(c.chunk_start, c.chunk_len) for c in decision.prefill] == [(0, 2), (0, 2)]
    assert list(decision.prefill[0].spec.prompt_token_ids) == [1, 2, 3]
    assert get_sequence(stub, s4).queue_position == 0


def test_rule1_finished_with_reason_preempted_is_requeued_not_finished(stub, worker):
    worker.register(max_batch_size=1)
    a, b = submit_many(stub, 2)
    worker.select()
    worker.select(finished=[(a, PREEMPTED, 0)], draining=True)
    info = get_sequence(stub, a)
    assert (info.state, info.queue_position) == (QUEUED, 0)
    assert get_sequence(stub, b).queue_position == 1


def test_rule1_assigned_ids_a_report_omits_are_lost_and_go_back_to_head(stub, worker):
    worker.register(max_batch_size=3)
    s1, s2, s3, s4 = submit_many(stub, 4)
    worker.select()
    worker.select(waiting=[s2], draining=True)
    assert [get_sequence(stub, s).queue_position for s in (s1, s3, s4)] == [0, 1, 2]
    assert get_sequence(stub, s1).state == QUEUED
    decision = worker.select(waiting=[s2])
    assert admitted(decision) == [s1, s3]
    assert all(c.chunk_start == 0 for c in decision.prefill if c.HasField("spec"))


def test_rule2_capacity_is_max_batch_size_minus_waiting_and_running(stub, worker):
    worker.register(max_batch_size=4)
    s = submit_many(stub, 6)
    assert admitted(worker.select()) == s[:4]
    decision = worker.select(waiting=[s[0]], running=[s[1]], finished=[(s[2], EOS), (s[3], EOS)])
    assert admitted(decision) == s[4:6]


def test_rule2_capacity_never_below_zero_when_a_report_exceeds_max_batch_size(stub, worker):
    worker.register(max_batch_size=2)
    a, b, c = submit_many(stub, 3)
    worker.select()
    decision = worker.select(running=[a, b, 999])  # 999: not ours, still counts as active
    assert admitted(decision) == [] and list(decision.evict) == [999]
    assert list(decision.decode) == [a, b]
    assert get_sequence(stub, c).state == QUEUED


def test_rule3_admissions_are_bounded_by_max_batch_size(stub, worker):
    worker.register(max_batch_size=2)
    s = submit_many(stub, 5)
    assert admitted(worker.select()) == s[:2]
    assert admitted(worker.select(waiting=s[:2])) == []


@config(max_batch_size=3)
def test_rule3_max_batch_size_zero_takes_the_scheduler_default(stub, worker):
    assert worker.register(max_batch_size=0).max_batch_size == 3
    s = submit_many(stub, 5)
    assert admitted(worker.select()) == s[:3]


@pytest.mark.parametrize("gdn_free_slots", [0, 1, 2])
def test_rule3_each_admission_needs_one_free_gdn_slot(stub, worker, gdn_free_slots):
    worker.register(max_batch_size=8)
    s = submit_many(stub, 4)
    assert admitted(worker.select(gdn_free_slots=gdn_free_slots)) == s[:gdn_free_slots]


@pytest.mark.parametrize("kv_free_pages, admits", [(7, False), (8, True)])
def test_rule3_reserve_guard_blocks_a_non_empty_batch_below_prefill_reserve_pages(
    stub, worker, kv_free_pages, admits
):
    worker.register(max_batch_size=4)
    a, b = submit_many(stub, 2)
    assert admitted(worker.select(gdn_free_slots=1)) == [a]
    decision = worker.select(running=[a], kv_free_pages=kv_free_pages)
    assert admitted(decision) == ([b] if admits else [])
    assert list(decision.decode) == [a]


def test_rule3_reserve_guard_is_bypassed_by_an_empty_batch(stub, worker):
    worker.register(max_batch_size=4)
    s = submit_many(stub, 2)
    assert admitted(worker.select(kv_free_pages=0)) == s


def test_rule4_every_running_id_is_decoded_in_the_order_given(stub, worker):
    worker.register(max_batch_size=4)
    s1, s2, s3 = submit_many(stub, 3)
    worker.select()
    decision = worker.select(running=[s3, s1, s2])
    assert list(decision.decode) == [s3, s1, s2]
    assert list(decision.prefill) == []


@config(chunk_size=4)
def test_rule5_continuations_carry_the_real_cursor_and_no_spec(stub, worker):
    worker.register()
    seq_id = submit(stub, prompt=range(10)).seq_id
    chunks = [worker.select().prefill[0]]
    for _ in range(2):
        chunks += worker.select(waiting=[seq_id]).prefill
    assert [(c.seq_id, c.chunk_start, c.chunk_len) for c in chunks] == [
        (seq_id, 0, 4),
        (seq_id, 4, 4),
        (seq_id, 8, 2),
    ]
    assert [c.HasField("spec") for c in chunks] == [True, False, False]


@config(chunk_size=4)
def test_rule5_new_admissions_come_before_continuations(stub, worker):
    worker.register()
    old = submit(stub, prompt=range(10)).seq_id
    worker.select()
    new = submit(stub, prompt=range(10)).seq_id
    decision = worker.select(waiting=[old])
    assert [(c.seq_id, c.chunk_start) for c in decision.prefill] == [(new, 0), (old, 4)]
    assert admitted(decision) == [new] and continued(decision) == [old]


def test_rule6_cancelled_sequences_are_evicted_and_neither_prefilled_nor_decoded(stub, worker):
    worker.register()
    waiting_id, running_id, kept = submit_many(stub, 3, prompt=range(3))
    worker.select()
    for seq_id in (waiting_id, running_id):
        assert stub.Cancel(pb.CancelRequest(seq_id=seq_id), timeout=RPC_TIMEOUT_SECONDS).cancelled
    decision = worker.select(waiting=[waiting_id], running=[running_id, kept])
    assert sorted(decision.evict) == sorted([waiting_id, running_id])
    assert [c.seq_id for c in decision.prefill] == []
    assert list(decision.decode) == [kept]
    assert get_sequence(stub, running_id).finish_reason == CANCELLED


def test_rule6_ids_reported_but_not_assigned_to_this_worker_are_evicted(stub, make_worker):
    a, b = make_worker("a"), make_worker("b")
    a.register(), b.register()
    on_b = submit(stub).seq_id
    b.select()
    decision = a.select(waiting=[on_b], running=[777])
    assert sorted(decision.evict) == sorted([on_b, 777])
    assert list(decision.decode) == [] and list(decision.prefill) == []
    info = get_sequence(stub, on_b)
    assert (info.state, info.worker_id) == (PREFILLING, "b")


def test_rule6_7_a_stale_id_reported_while_queued_is_evicted_not_admitted(stub, worker):
    worker.register()
    seq_id = submit(stub).seq_id
    worker.select()
    worker.register()  # new incarnation: seq_id goes back to the queue
    decision = worker.select(waiting=[seq_id])
    assert list(decision.evict) == [seq_id]
    assert [c.seq_id for c in decision.prefill] == []
    assert get_sequence(stub, seq_id).state == QUEUED
    assert admitted(worker.select()) == [seq_id]


@config(chunk_size=2, max_batch_size=6)
def test_rule7_no_id_twice_in_prefill_nor_in_both_prefill_and_decode(stub, worker):
    worker.register()
    ids = submit_many(stub, 8, prompt=range(5))
    holding: dict[str, list[int]] = {"waiting": [], "running": []}
    for step in range(8):
        # A worker that moves each sequence through prefill into decode, preempting one
        # and finishing one now and then.
        preempted = holding["running"][:1] if step % 3 == 2 else []
        finished = [(s, EOS) for s in holding["running"][1:2]] if step % 4 == 3 else []
        gone = set(preempted) | {f[0] for f in finished}
        running = [s for s in holding["running"] if s not in gone]
        decision = worker.select(
            waiting=holding["waiting"], running=running, preempted=preempted, finished=finished
        )
        prefill_ids = [c.seq_id for c in decision.prefill]
        assert len(prefill_ids) == len(set(prefill_ids)), decision
        assert not set(prefill_ids) & set(decision.decode), decision
        assert not (set(prefill_ids) | set(decision.decode)) & set(decision.evict), decision
        new_running = running + continued(decision)
        holding = {"waiting": admitted(decision), "running": new_running}
    assert set(ids) >= set(holding["running"])


# ===================================================================== workers

# Short enough to expire within a test, long enough that a loaded CI box calling every
# 50 ms never misses it.
SHORT_LEASE_MS = 400


def test_register_of_an_existing_worker_id_requeues_its_sequences_at_head(stub, worker):
    worker.register(max_batch_size=2)
    a, b, c = submit_many(stub, 3)
    worker.select()
    worker.select(waiting=[a, b])
    worker.register(max_batch_size=2)  # the worker restarted
    assert [get_sequence(stub, s).queue_position for s in (a, b, c)] == [0, 1, 2]
    assert get_sequence(stub, a).state == QUEUED
    decision = worker.select()
    assert admitted(decision) == [a, b]
    assert [(ch.chunk_start, ch.HasField("spec")) for ch in decision.prefill] == [
        (0, True),
        (0, True),
    ]


@config(lease_ttl_ms=SHORT_LEASE_MS)
def test_lease_expiry_requeues_and_fails_precondition_until_registered_again(stub, worker):
    worker.register()
    seq_id = submit(stub).seq_id
    worker.select()
    wait_until(
        lambda: get_sequence(stub, seq_id).state == QUEUED,
        "the silent worker's sequence to go back to the queue",
        5,
    )
    err = rpc_error(lambda: worker.select(waiting=[seq_id]))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "w1" in err.details()
    worker.register()
    assert admitted(worker.select()) == [seq_id]


@config(lease_ttl_ms=SHORT_LEASE_MS)
def test_lease_is_kept_alive_by_select_batch_calls(stub, worker):
    worker.register()
    seq_id = submit(stub).seq_id
    worker.select()
    deadline = time.monotonic() + 3 * SHORT_LEASE_MS / 1000
    while time.monotonic() < deadline:
        worker.select(running=[seq_id])
        time.sleep(0.05)
    info = get_sequence(stub, seq_id)
    assert (info.state, info.worker_id) == (DECODING, "w1")


def test_deregistered_worker_must_register_again(stub, worker):
    worker.register()
    assert worker.deregister().requeued == 0
    assert rpc_error(lambda: worker.select()).code() == grpc.StatusCode.FAILED_PRECONDITION
    worker.register()
    assert worker.select().iteration == 1


def test_draining_admits_nothing_but_keeps_decode_and_continuations(stub, worker):
    worker.register()
    prefilling, decoding = submit_many(stub, 2, prompt=range(1000))
    queued = submit(stub).seq_id
    # Admit only the first two (one slot each), then drain.
    worker.select(gdn_free_slots=2)
    decision = worker.select(waiting=[prefilling], running=[decoding], draining=True)
    assert admitted(decision) == []
    assert continued(decision) == [prefilling] and list(decision.decode) == [decoding]
    assert get_sequence(stub, queued).state == QUEUED
    assert admitted(worker.select(waiting=[prefilling], running=[decoding])) == [queued]


# ===================================================================== GetSequence


@config(chunk_size=4)
def test_get_sequence_fields_across_the_lifecycle(stub, worker):
    seq_id = submit(stub, prompt=range(10), max_new_tokens=5).seq_id

    def info():
        i = get_sequence(stub, seq_id)
        return (
            i.seq_id,
            i.state,
            i.worker_id,
            i.prompt_len,
            i.prefilled_tokens,
            i.generated_tokens,
            i.finish_reason,
        )

    unspecified = pb.FINISH_REASON_UNSPECIFIED
    assert info() == (seq_id, QUEUED, "", 10, 0, 0, unspecified)
    worker.register()
    worker.select()  # chunk [0, 4) handed out
    assert info() == (seq_id, PREFILLING, "w1", 10, 0, 0, unspecified)
    worker.select(waiting=[seq_id])  # [0, 4) done, [4, 8) out
    assert info() == (seq_id, PREFILLING, "w1", 10, 4, 0, unspecified)
    worker.select(waiting=[seq_id])  # [4, 8) done, [8, 10) out
    assert info() == (seq_id, PREFILLING, "w1", 10, 8, 0, unspecified)
    worker.select(running=[seq_id], tokens={seq_id: [42]})  # prefill done, first token
    assert info() == (seq_id, DECODING, "w1", 10, 10, 1, unspecified)
    worker.select(running=[seq_id], tokens={seq_id: [43, 44]})
    assert info() == (seq_id, DECODING, "w1", 10, 10, 3, unspecified)
    worker.select(finished=[(seq_id, EOS, 4)], tokens={seq_id: [45]})
    assert info()[:2] == (seq_id, FINISHED)
    assert info()[2] == "" and info()[5:] == (4, EOS)


# ===================================================================== tokens, streaming


def _generate(stub, prompt=(1, 2, 3), max_new_tokens=5) -> Stream:
    return Stream(
        stub, pb.SubmitRequest(prompt_token_ids=list(prompt), max_new_tokens=max_new_tokens)
    )


def test_generate_streams_seq_id_then_tokens_then_a_finished_event(stub, worker):
    stream = _generate(stub, max_new_tokens=4)
    first = stream.next_event()
    seq_id = first.seq_id
    assert seq_id > 0 and list(first.token_ids) == [] and not first.finished
    assert get_sequence(stub, seq_id).state == QUEUED
    worker.register()
    assert admitted(worker.select()) == [seq_id]
    worker.select(running=[seq_id], tokens={seq_id: [5]})
    assert stream.tokens_until(1) == [5]
    worker.select(running=[seq_id], tokens={seq_id: [6, 7]})
    assert stream.tokens_until(2) == [6, 7]
    worker.select(finished=[(seq_id, MAX_LENGTH, 4)], tokens={seq_id: [8]})
    events = stream.rest()
    assert [t for e in events for t in e.token_ids] == [8]
    assert all(e.seq_id == seq_id for e in events)
    assert events[-1].finished and events[-1].finish_reason == MAX_LENGTH
    assert not any(e.finished for e in events[:-1])


def test_select_batch_tokens_are_counted_in_generated_tokens(stub, worker):
    worker.register()
    seq_id = submit(stub, max_new_tokens=8).seq_id
    worker.select()
    worker.select(running=[seq_id], tokens={seq_id: [1]})
    worker.select(running=[seq_id], tokens={seq_id: [2, 3]})
    assert get_sequence(stub, seq_id).generated_tokens == 3


def test_generate_call_cancelled_by_its_client_cancels_the_sequence(stub, worker):
    worker.register()
    stream = _generate(stub)
    seq_id = stream.next_event().seq_id
    worker.select()
    stream.call.cancel()
    wait_until(
        lambda: get_sequence(stub, seq_id).state == FINISHED,
        "the abandoned sequence to be cancelled",
        5,
    )
    assert get_sequence(stub, seq_id).finish_reason == CANCELLED
    assert list(worker.select(waiting=[seq_id]).evict) == [seq_id]


def test_generate_stream_ends_finished_cancelled_when_another_client_cancels(stub):
    stream = _generate(stub)
    seq_id = stream.next_event().seq_id
    stub.Cancel(pb.CancelRequest(seq_id=seq_id), timeout=RPC_TIMEOUT_SECONDS)
    (last,) = stream.rest()
    assert last.finished and last.finish_reason == CANCELLED


def test_follow_sequence_streams_from_start_and_its_caller_leaving_cancels_nothing(stub, worker):
    worker.register()
    seq_id = submit(stub, max_new_tokens=4).seq_id
    worker.select()
    worker.select(running=[seq_id], tokens={seq_id: [5, 6]})
    call = stub.FollowSequence(pb.FollowSequenceRequest(seq_id=seq_id, start=1), timeout=10)
    first = next(call)
    assert (first.seq_id, list(first.token_ids), first.finished) == (seq_id, [6], False)
    call.cancel()
    time.sleep(0.2)
    assert get_sequence(stub, seq_id).state == DECODING
    worker.select(finished=[(seq_id, MAX_LENGTH, 4)], tokens={seq_id: [7, 8]})
    events = list(stub.FollowSequence(pb.FollowSequenceRequest(seq_id=seq_id), timeout=10))
    assert [t for e in events for t in e.token_ids] == [5, 6, 7, 8]
    assert events[-1].finished and events[-1].finish_reason == MAX_LENGTH


def test_follow_sequence_of_an_unknown_seq_id_is_not_found(stub):
    seq_id = submit(stub).seq_id
    with pytest.raises(grpc.RpcError) as err:
        list(stub.FollowSequence(pb.FollowSequenceRequest(seq_id=seq_id + 100), timeout=10))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def _requeue_by(action: str, stub, worker: Worker, seq_id: int) -> None:
    """Send seq_id (decoding on worker, 1 token so far) back to the queue; it makes token 11."""
    if action == "preempted":
        worker.select(preempted=[seq_id], tokens={seq_id: [11]}, draining=True)
    elif action == "finished_preempted":
        worker.select(finished=[(seq_id, PREEMPTED, 2)], tokens={seq_id: [11]}, draining=True)
    else:
        worker.select(running=[seq_id], tokens={seq_id: [11]})
        if action == "lost":
            worker.select(draining=True)
        elif action == "reregistered":
            worker.register()
        elif action == "deregistered":
            assert worker.deregister().requeued == 1
            worker.register()
    assert get_sequence(stub, seq_id).state == QUEUED


@pytest.mark.parametrize(
    "action", ["preempted", "finished_preempted", "lost", "reregistered", "deregistered"]
)
def test_requeued_sequence_resumes_from_prompt_plus_generated_and_never_repeats_a_token(
    stub, worker, action
):
    stream = _generate(stub, prompt=(1, 2, 3), max_new_tokens=5)
    seq_id = stream.next_event().seq_id
    worker.register()
    worker.select()
    worker.select(running=[seq_id], tokens={seq_id: [10]})
    _requeue_by(action, stub, worker, seq_id)
    assert get_sequence(stub, seq_id).generated_tokens == 2

    (chunk,) = worker.select().prefill
    assert (chunk.seq_id, chunk.chunk_start, chunk.chunk_len) == (seq_id, 0, 5)
    assert list(chunk.spec.prompt_token_ids) == [1, 2, 3, 10, 11]
    assert chunk.spec.max_new_tokens == 3
    worker.select(running=[seq_id], tokens={seq_id: [12]})
    worker.select(running=[seq_id], tokens={seq_id: [13]})
    worker.select(finished=[(seq_id, MAX_LENGTH, 3)], tokens={seq_id: [14]})

    events = stream.rest()
    assert [t for e in events for t in e.token_ids] == [10, 11, 12, 13, 14]
    assert events[-1].finished and events[-1].finish_reason == MAX_LENGTH
    assert get_sequence(stub, seq_id).generated_tokens == 5


@config(lease_ttl_ms=SHORT_LEASE_MS)
def test_sequence_requeued_by_lease_expiry_resumes_with_generated_tokens(stub, make_worker):
    silent, other = make_worker("silent"), make_worker("other")
    silent.register()
    seq_id = submit(stub, prompt=(1, 2), max_new_tokens=4).seq_id
    silent.select()
    silent.select(running=[seq_id], tokens={seq_id: [7, 8]})
    wait_until(lambda: get_sequence(stub, seq_id).state == QUEUED, "lease expiry", 5)
    other.register()
    (chunk,) = other.select().prefill
    assert list(chunk.spec.prompt_token_ids) == [1, 2, 7, 8]
    assert chunk.spec.max_new_tokens == 2


# ===================================================================== health, reflection


@pytest.mark.parametrize("service", ["", "lattice.scheduler.v1.Scheduler"])
def test_health_reports_serving_for_the_server_and_the_scheduler_service(server, service):
    health = health_pb2_grpc.HealthStub(server.channel)
    resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT_SECONDS)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_stop_turns_health_not_serving_before_the_server_goes(start_server):
    server = start_server()
    channel = grpc.insecure_channel(server.target)
    watch = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service="lattice.scheduler.v1.Scheduler"), timeout=10
    )
    statuses = []
    try:
        statuses.append(next(watch).status)
        stopper = threading.Thread(target=server.stop, args=(2.0,))
        stopper.start()
        statuses.append(next(watch).status)
        watch.cancel()  # the last call in flight: the server can go now
        stopper.join(timeout=10)
        assert not stopper.is_alive()
    finally:
        channel.close()
    assert statuses == [
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    ]


def test_reflection_lists_and_describes_the_scheduler_service(server):
    from google.protobuf.descriptor_pool import DescriptorPool

    db = ProtoReflectionDescriptorDatabase(server.channel)
    services = db.get_services()
    assert "lattice.scheduler.v1.Scheduler" in services
    assert "grpc.health.v1.Health" in services
    service = DescriptorPool(db).FindServiceByName("lattice.scheduler.v1.Scheduler")
    assert {m.name for m in service.methods} >= {
        "Submit",
        "Cancel",
        "GetSequence",
        "Generate",
        "RegisterWorker",
        "SelectBatch",
        "DeregisterWorker",
        "DrainWorker",
    }


# ===================================================================== metrics


def test_metric_queue_depth_follows_submit_admission_and_cancel(server, stub, worker):
    assert server.metric("queue_depth") == 0
    ids = submit_many(stub, 3)
    assert server.metric("queue_depth") == 3
    worker.register(max_batch_size=2)
    worker.select()
    assert server.metric("queue_depth") == 1
    stub.Cancel(pb.CancelRequest(seq_id=ids[2]), timeout=RPC_TIMEOUT_SECONDS)
    assert server.metric("queue_depth") == 0
    worker.select(draining=True)  # both lost: back in the queue
    assert server.metric("queue_depth") == 2


def test_metric_admissions_total_counts_every_admission_requeues_included(server, stub, worker):
    worker.register()
    a, _ = submit_many(stub, 2)
    worker.select()
    assert server.metric("admissions_total") == 2
    worker.select(waiting=[a], draining=True)  # the other one is lost
    assert server.metric("admissions_total") == 2
    worker.select(waiting=[a])  # and admitted again
    assert server.metric("admissions_total") == 3


def test_metric_select_batch_duration_counts_each_answered_call(server, worker):
    worker.register()
    for _ in range(3):
        worker.select()
    assert server.metric("select_batch_duration_seconds_count") == 3
    assert server.metric("select_batch_duration_seconds_sum") > 0


def test_metric_worker_free_pages_and_slots_are_last_reported_per_worker(make_worker, server, stub):
    a, b = make_worker("a"), make_worker("b")
    a.register(), b.register()
    a.select(kv_free_pages=100, gdn_free_slots=7)
    a.select(kv_free_pages=90, gdn_free_slots=6)
    b.select(kv_free_pages=5, gdn_free_slots=1)
    assert server.metric("worker_kv_free_pages", worker_id="a") == 90
    assert server.metric("worker_gdn_free_slots", worker_id="a") == 6
    assert server.metric("worker_kv_free_pages", worker_id="b") == 5
    assert server.metric("worker_gdn_free_slots", worker_id="b") == 1


def test_metric_worker_series_are_removed_when_the_worker_deregisters(make_worker, server, stub):
    leaving, staying = make_worker("leaving"), make_worker("staying")
    for w in (leaving, staying):
        w.register()
        w.select(kv_free_pages=50, gdn_free_slots=4)
    leaving.deregister()
    for name in ("worker_kv_free_pages", "worker_gdn_free_slots"):
        assert server.metric(name, worker_id="leaving") is None
        assert server.metric(name, worker_id="staying") == (50 if "kv" in name else 4)
    scraped = server.scrape()
    assert not [key for key in scraped if ("worker_id", "leaving") in key[1]]


@config(lease_ttl_ms=SHORT_LEASE_MS)
def test_metric_worker_series_are_removed_when_the_lease_expires(server, worker):
    worker.register()
    worker.select(kv_free_pages=50, gdn_free_slots=4)
    wait_until(
        lambda: server.metric("worker_kv_free_pages", worker_id="w1") is None,
        "the expired worker's series to go",
        5,
    )
    assert server.metric("worker_gdn_free_slots", worker_id="w1") is None


def test_metrics_endpoint_serves_the_contract_names_with_the_values_caused(server, stub, worker):
    submit_many(stub, 3)
    worker.register(max_batch_size=2)
    worker.select(kv_free_pages=321, gdn_free_slots=12)
    worker.select(kv_free_pages=300, gdn_free_slots=10, waiting=[1, 2])
    scraped = server.scrape()
    expected = {
        ("lattice_scheduler_queue_depth", ()): 1,
        ("lattice_scheduler_admissions_total", ()): 2,
        ("lattice_scheduler_select_batch_duration_seconds_count", ()): 2,
        ("lattice_scheduler_worker_kv_free_pages", (("worker_id", "w1"),)): 300,
        ("lattice_scheduler_worker_gdn_free_slots", (("worker_id", "w1"),)): 10,
    }
    assert {key: scraped.get(key) for key in expected} == expected
    assert all(
        name.startswith("lattice_scheduler_")
        for name, _ in scraped
        if not name.startswith(("python_", "process_"))
    )


# ===================================================================== additions beyond the table


def test_token_update_with_offset_adds_no_token_twice_when_a_report_is_retried(stub, worker):
    worker.register()
    seq_id = submit(stub, max_new_tokens=8).seq_id
    worker.select()

    def report(offset, token_ids):
        return worker.send(
            pb.SelectBatchRequest(
                worker_id="w1",
                running=[seq_id],
                kv_free_pages=1000,
                gdn_free_slots=64,
                tokens=[pb.TokenUpdate(seq_id=seq_id, token_ids=token_ids, offset=offset)],
            )
        )

    report(0, [5, 6])
    report(0, [5, 6])  # the same report again (the worker retried)
    report(1, [6, 7])  # overlaps by one token
    assert get_sequence(stub, seq_id).generated_tokens == 3


def test_requeue_of_a_sequence_with_every_token_generated_finishes_it_max_length(stub, worker):
    stream = _generate(stub, prompt=(1,), max_new_tokens=2)
    seq_id = stream.next_event().seq_id
    worker.register()
    worker.select()
    worker.select(running=[seq_id], tokens={seq_id: [5, 6]})
    decision = worker.select(preempted=[seq_id])  # nothing left to resume
    assert seq_id not in admitted(decision)
    info = get_sequence(stub, seq_id)
    assert (info.state, info.finish_reason) == (FINISHED, MAX_LENGTH)
    events = stream.rest()
    assert [t for e in events for t in e.token_ids] == [5, 6]
    assert events[-1].finished and events[-1].finish_reason == MAX_LENGTH
