"""The fifo rules 1-7 of docs/contract.md, the core's errors, and the worker lifecycle."""

import pytest

from service.core import (
    FinishReason,
    InvalidArgument,
    NotFound,
    PrefillChunk,
    QueueFull,
    Scheduler,
    SequenceState,
    UnknownWorker,
)

from .factories import (
    FakeClock,
    admit,
    finished,
    make_config,
    make_scheduler,
    params,
    prefill_ids,
    register,
    report,
    submit,
)


def setup(num_workers=1, **config_overrides):
    config = dict(max_batch_size=32, chunk_size=512, prefill_reserve_pages=0)
    config.update(config_overrides)
    clock = FakeClock()
    sched = make_scheduler(clock, **config)
    for index in range(num_workers):
        register(sched, f"w{index}")
    return sched, clock


def queue_order(sched, seq_ids):
    """The queued ones among `seq_ids`, head first."""
    infos = [sched.get_sequence(s) for s in seq_ids]
    queued = [i for i in infos if i.state is SequenceState.QUEUED]
    return [i.seq_id for i in sorted(queued, key=lambda i: i.queue_position)]


# --------------------------------------------------------------- rule 1: the report


def test_finished_sequence_ends_and_is_no_longer_assigned():
    sched, _ = setup()
    seq_id = submit(sched)
    admit(sched)
    decision = sched.select_batch(report(finished=[finished(seq_id, FinishReason.STOP)]))
    info = sched.get_sequence(seq_id)
    assert info.state is SequenceState.FINISHED
    assert info.finish_reason is FinishReason.STOP
    assert info.worker_id == ""
    assert sched.status().num_assigned == 0
    assert seq_id not in prefill_ids(decision) + list(decision.decode)


def test_preempted_sequences_go_to_queue_head_in_the_order_given():
    sched, _ = setup(max_batch_size=2)
    a, b, c = submit(sched), submit(sched), submit(sched)
    assert admit(sched) == (a, b)
    sched.select_batch(report(preempted=[b, a], gdn_free_slots=0))
    assert queue_order(sched, [a, b, c]) == [b, a, c]


def test_finish_reason_preempted_requeues_instead_of_finishing():
    sched, _ = setup()
    seq_id = submit(sched)
    admit(sched)
    sched.select_batch(
        report(finished=[finished(seq_id, FinishReason.PREEMPTED)], gdn_free_slots=0)
    )
    info = sched.get_sequence(seq_id)
    assert info.state is SequenceState.QUEUED and info.finish_reason is None


def test_assigned_sequence_not_mentioned_is_lost_and_requeued_at_head():
    sched, _ = setup(max_batch_size=2)
    kept, lost, queued = submit(sched), submit(sched), submit(sched)
    assert admit(sched) == (kept, lost)
    decision = sched.select_batch(report(running=[kept], gdn_free_slots=0))
    assert decision.decode == (kept,)
    assert queue_order(sched, [kept, lost, queued]) == [lost, queued]


def test_requeued_sequence_is_prefilled_again_from_token_zero():
    sched, _ = setup(chunk_size=4)
    seq_id = submit(sched, prompt_len=10)
    admit(sched)
    sched.select_batch(report(waiting=[seq_id]))  # cursor 4 -> 8
    sched.select_batch(report(preempted=[seq_id], gdn_free_slots=0))
    assert sched.get_sequence(seq_id).prefilled_tokens == 0
    decision = sched.select_batch(report())
    assert decision.prefill[0].chunk_start == 0 and decision.prefill[0].chunk_len == 4
    assert decision.prefill[0].spec is not None
    assert sched.select_batch(report(waiting=[seq_id])).prefill[0].chunk_start == 4


def test_report_repeating_a_preempted_id_requeues_it_once():
    sched, _ = setup()
    seq_id = submit(sched)
    admit(sched)
    sched.select_batch(
        report(
            preempted=[seq_id, seq_id],
            finished=[finished(seq_id, FinishReason.PREEMPTED)],
            gdn_free_slots=0,
        )
    )
    assert sched.get_sequence(seq_id).state is SequenceState.QUEUED
    assert sched.status().queue_depth == 1


def test_sequence_reported_both_preempted_and_finished_ends_finished():
    sched, _ = setup()
    seq_id = submit(sched)
    admit(sched)
    sched.select_batch(
        report(
            finished=[finished(seq_id, FinishReason.PREEMPTED), finished(seq_id, FinishReason.EOS)],
            gdn_free_slots=0,
        )
    )
    info = sched.get_sequence(seq_id)
    assert info.state is SequenceState.FINISHED and info.finish_reason is FinishReason.EOS
    assert sched.status().queue_depth == 0


# --------------------------------------------------- rules 2-3: capacity and admission


def test_admissions_come_from_the_queue_head_in_submit_order():
    sched, _ = setup(max_batch_size=3)
    seq_ids = [submit(sched) for _ in range(5)]
    assert admit(sched) == tuple(seq_ids[:3])
    assert queue_order(sched, seq_ids) == seq_ids[3:]


def test_capacity_is_max_batch_size_minus_waiting_and_running():
    sched, _ = setup(max_batch_size=4, chunk_size=4)
    prefilling = submit(sched, prompt_len=10)
    decoding = submit(sched, prompt_len=4)
    assert admit(sched, gdn_free_slots=2) == (prefilling, decoding)
    queued = [submit(sched) for _ in range(3)]
    decision = sched.select_batch(report(waiting=[prefilling], running=[decoding]))
    assert [c.seq_id for c in decision.prefill if c.spec] == queued[:2]


def test_worker_max_batch_size_overrides_the_default_and_zero_means_default():
    sched, _ = setup(num_workers=0, max_batch_size=3)
    assert register(sched, "small", max_batch_size=1).max_batch_size == 1
    assert register(sched, "default", max_batch_size=0).max_batch_size == 3
    seq_ids = [submit(sched) for _ in range(5)]
    assert admit(sched, "small") == (seq_ids[0],)
    assert admit(sched, "default") == tuple(seq_ids[1:4])


def test_more_active_than_max_batch_size_admits_nothing():
    sched, _ = setup(max_batch_size=1)
    a, b = submit(sched), submit(sched)
    assert admit(sched) == (a,)
    c = submit(sched)
    # b is queued: reporting it makes active 2 > max_batch_size 1; capacity stays 0.
    decision = sched.select_batch(report(running=[a, b]))
    assert [ch for ch in decision.prefill if ch.spec] == []
    assert queue_order(sched, [b, c]) == [b, c]


def test_gdn_free_slots_bound_the_number_of_admissions():
    sched, _ = setup()
    seq_ids = [submit(sched) for _ in range(5)]
    assert admit(sched, gdn_free_slots=2) == tuple(seq_ids[:2])
    assert admit(sched, "w0", running=seq_ids[:2], gdn_free_slots=0) == ()


def test_reserve_guard_blocks_admission_below_reserve_when_batch_is_active():
    sched, _ = setup(prefill_reserve_pages=8)
    running = submit(sched)
    admit(sched)
    new = submit(sched)
    assert admit(sched, running=[running], kv_free_pages=7) == ()
    assert admit(sched, running=[running], kv_free_pages=8) == (new,)


def test_first_chunk_is_min_of_chunk_size_and_prompt_len():
    sched, _ = setup(chunk_size=16)
    short, long = submit(sched, prompt_len=5), submit(sched, prompt_len=40)
    decision = sched.select_batch(report())
    assert [(c.seq_id, c.chunk_start, c.chunk_len) for c in decision.prefill] == [
        (short, 0, 5),
        (long, 0, 16),
    ]


def test_first_chunk_carries_the_full_spec():
    sched, _ = setup()
    submitted = params(prompt_len=6, max_new_tokens=3, adapter_id="", stop_token_ids=(2,))
    seq_id = sched.submit(submitted).seq_id
    spec = sched.select_batch(report()).prefill[0].spec
    assert sched.get_sequence(seq_id).state is SequenceState.PREFILLING
    assert spec.prompt_token_ids == submitted.prompt_token_ids
    assert spec.max_new_tokens == 3
    assert spec.stop_token_ids == (2,)
    assert spec.sampling == submitted.sampling


def test_draining_worker_gets_no_admissions_but_keeps_prefill_and_decode():
    sched, _ = setup(chunk_size=4)
    waiting, running = submit(sched, prompt_len=10), submit(sched, prompt_len=4)
    admit(sched)
    queued = submit(sched)
    decision = sched.select_batch(report(waiting=[waiting], running=[running], draining=True))
    assert decision.prefill == (PrefillChunk(waiting, 4, 4),)
    assert decision.decode == (running,)
    assert sched.get_sequence(queued).state is SequenceState.QUEUED
    assert admit(sched, draining=True) == ()


def test_sequence_with_adapter_goes_only_to_a_worker_that_registered_it():
    sched, _ = setup(num_workers=0)
    register(sched, "base")
    register(sched, "lora", adapters=("a",))
    needs_a = submit(sched, adapter_id="a")
    base = submit(sched)
    # The base worker skips the adapter sequence without blocking the one behind it.
    assert admit(sched, "base") == (base,)
    assert sched.get_sequence(needs_a).state is SequenceState.QUEUED
    assert admit(sched, "lora") == (needs_a,)
    assert sched.get_sequence(needs_a).worker_id == "lora"


# ------------------------------------------------------ rules 4-5: decode, continuations


def test_decode_lists_running_ids_in_the_order_reported():
    sched, _ = setup()
    a, b, c = submit(sched), submit(sched), submit(sched)
    admit(sched)
    decision = sched.select_batch(report(running=[c, a, b]))
    assert decision.decode == (c, a, b)
    assert sched.get_sequence(a).state is SequenceState.DECODING


def test_continuations_walk_the_prompt_chunk_by_chunk():
    sched, _ = setup(chunk_size=128)
    seq_id = submit(sched, prompt_len=300)
    first = sched.select_batch(report()).prefill[0]
    second = sched.select_batch(report(waiting=[seq_id])).prefill[0]
    third = sched.select_batch(report(waiting=[seq_id])).prefill[0]
    assert [(c.chunk_start, c.chunk_len) for c in (first, second, third)] == [
        (0, 128),
        (128, 128),
        (256, 44),
    ]
    assert second.spec is None and third.spec is None


def test_prefilled_tokens_counts_confirmed_chunks_then_the_whole_prompt():
    sched, _ = setup(chunk_size=4)
    seq_id = submit(sched, prompt_len=10)
    admit(sched)
    assert sched.get_sequence(seq_id).prefilled_tokens == 0
    sched.select_batch(report(waiting=[seq_id]))
    assert sched.get_sequence(seq_id).prefilled_tokens == 4
    sched.select_batch(report(running=[seq_id], tokens={seq_id: [90]}))
    sched.select_batch(report(running=[seq_id], tokens={seq_id: [91]}))
    info = sched.get_sequence(seq_id)
    assert (info.prefilled_tokens, info.generated_tokens) == (10, 2)


# ----------------------------------------------------------- rule 6: evict


def test_cancelled_running_sequence_is_evicted_and_not_decoded():
    sched, _ = setup()
    keep, cancel = submit(sched), submit(sched)
    admit(sched)
    assert sched.cancel(cancel) is True
    decision = sched.select_batch(report(running=[keep, cancel]))
    assert decision.evict == (cancel,)
    assert decision.decode == (keep,)
    info = sched.get_sequence(cancel)
    assert info.state is SequenceState.FINISHED and info.finish_reason is FinishReason.CANCELLED


def test_cancelled_prefilling_sequence_is_evicted_and_gets_no_chunk():
    sched, _ = setup(chunk_size=4)
    seq_id = submit(sched, prompt_len=10)
    admit(sched)
    sched.cancel(seq_id)
    decision = sched.select_batch(report(waiting=[seq_id]))
    assert decision.evict == (seq_id,)
    assert decision.prefill == ()


def test_id_never_assigned_to_the_worker_is_evicted():
    sched, _ = setup(num_workers=2)
    theirs = submit(sched)
    assert admit(sched, "w1") == (theirs,)
    decision = sched.select_batch(report("w0", waiting=[theirs], running=[12345]))
    assert decision.evict == (theirs, 12345)
    assert decision.prefill == () and decision.decode == ()
    # w0's claim does not take the sequence away from w1.
    assert sched.get_sequence(theirs).worker_id == "w1"
    assert sched.select_batch(report("w1", running=[theirs])).decode == (theirs,)


def test_queued_id_reported_by_a_worker_is_evicted_not_admitted_in_the_same_call():
    sched, _ = setup()
    seq_id = submit(sched)
    admit(sched)
    register(sched, "w0")  # new incarnation: seq_id is back in the queue
    decision = sched.select_batch(report(waiting=[seq_id]))
    assert decision.evict == (seq_id,)
    assert prefill_ids(decision) == []  # rule 7: never in both evict and prefill
    assert sched.get_sequence(seq_id).state is SequenceState.QUEUED


# ---------------------------------------------------------------- submit and errors


def test_submit_reports_the_number_of_sequences_ahead():
    sched, _ = setup()
    positions = [sched.submit(params()).queue_position for _ in range(3)]
    assert positions == [0, 1, 2]


def test_seq_ids_are_never_reused():
    sched, _ = setup()
    first = submit(sched)
    sched.cancel(first)
    assert submit(sched) != first


@pytest.mark.parametrize(
    "bad, field",
    [
        (params(prompt_len=0), "prompt_token_ids"),
        (params(max_new_tokens=0), "max_new_tokens"),
        (params(prompt_len=60, max_new_tokens=5), "max_seq_len=64"),
    ],
)
def test_invalid_submit_is_rejected_naming_the_field(bad, field):
    sched, _ = setup(chunk_size=16, max_seq_len=64)
    with pytest.raises(InvalidArgument, match=field):
        sched.submit(bad)
    assert sched.status().queue_depth == 0


def test_prompt_plus_max_new_tokens_equal_to_max_seq_len_is_accepted():
    sched, _ = setup(chunk_size=16, max_seq_len=64)
    submit(sched, prompt_len=60, max_new_tokens=4)


def test_submit_beyond_max_queue_is_refused_naming_the_limit():
    sched, _ = setup(max_queue=2)
    submit(sched), submit(sched)
    with pytest.raises(QueueFull, match="max_queue=2"):
        submit(sched)
    assert sched.status().queue_depth == 2


def test_admission_frees_queue_room_for_new_submissions():
    sched, _ = setup(max_queue=1)
    submit(sched)
    admit(sched)
    submit(sched)


def test_requeue_onto_a_full_queue_keeps_every_sequence_and_submit_stays_refused():
    # Requeued sequences are never dropped, so the queue may exceed max_queue that way.
    sched, _ = setup(max_queue=1)
    running = submit(sched)
    admit(sched)
    queued = submit(sched)
    sched.select_batch(report(preempted=[running], gdn_free_slots=0))
    assert queue_order(sched, [running, queued]) == [running, queued]
    with pytest.raises(QueueFull):
        submit(sched)


def test_repeated_request_id_returns_the_first_seq_id_and_enqueues_nothing():
    sched, _ = setup(max_queue=1)
    first = sched.submit(params(request_id="req-1"))
    again = sched.submit(params(prompt_len=3, request_id="req-1"))  # even with a full queue
    assert again.seq_id == first.seq_id
    assert sched.status().queue_depth == 1


def test_empty_request_id_is_not_an_idempotency_key():
    sched, _ = setup()
    assert submit(sched, request_id="") != submit(sched, request_id="")


def test_repeated_request_id_of_a_running_sequence_returns_it():
    sched, _ = setup()
    seq_id = submit(sched, request_id="req-1")
    admit(sched)
    assert sched.submit(params(request_id="req-1")).seq_id == seq_id
    assert sched.status().queue_depth == 0


@pytest.mark.parametrize("call", ["cancel", "get_sequence"])
def test_unknown_seq_id_is_not_found(call):
    sched, _ = setup()
    with pytest.raises(NotFound, match="seq_id 777"):
        getattr(sched, call)(777)


def test_select_batch_from_an_unregistered_worker_is_refused():
    sched, _ = setup()
    with pytest.raises(UnknownWorker, match="'stranger'"):
        sched.select_batch(report("stranger"))


def test_deregister_of_an_unregistered_worker_is_refused():
    sched, _ = setup()
    with pytest.raises(UnknownWorker):
        sched.deregister_worker("stranger")


@pytest.mark.parametrize(
    "bad",
    [
        dict(waiting=[1, 1]),
        dict(running=[1, 1]),
        dict(waiting=[1], running=[1]),
    ],
)
def test_id_twice_in_waiting_or_running_is_invalid_and_changes_nothing(bad):
    sched, _ = setup()
    seq_id = submit(sched)
    assert seq_id == 1
    admit(sched)
    iteration = sched.status().workers[0].iteration
    with pytest.raises(InvalidArgument, match="seq_id 1"):
        sched.select_batch(report(**bad))
    assert sched.get_sequence(seq_id).worker_id == "w0"
    assert sched.status().workers[0].iteration == iteration


@pytest.mark.parametrize(
    "bad",
    [
        dict(waiting=[1], finished=[finished(1)]),
        dict(running=[1], preempted=[1]),
    ],
)
def test_id_both_active_and_finished_or_preempted_is_invalid(bad):
    sched, _ = setup()
    submit(sched)
    admit(sched)
    with pytest.raises(InvalidArgument, match="seq_id 1"):
        sched.select_batch(report(**bad))
    assert sched.get_sequence(1).state is SequenceState.PREFILLING


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(worker_id=""), "worker_id"),
        (dict(worker_id="w9", page_size=0), "page_size"),
    ],
)
def test_invalid_registration_is_rejected_naming_the_field(bad, field):
    sched, _ = setup(num_workers=0)
    worker_id = bad.pop("worker_id")
    with pytest.raises(InvalidArgument, match=field):
        register(sched, worker_id, **bad)
    assert sched.status().workers == ()


# ---------------------------------------------------------------- cancel


def test_cancel_of_a_queued_sequence_removes_it_from_the_queue():
    sched, _ = setup()
    cancelled, other = submit(sched), submit(sched)
    assert sched.cancel(cancelled) is True
    assert sched.status().queue_depth == 1
    assert sched.get_sequence(other).queue_position == 0
    assert admit(sched) == (other,)


def test_cancel_of_a_finished_sequence_returns_false_and_keeps_its_reason():
    sched, _ = setup()
    seq_id = submit(sched)
    admit(sched)
    sched.select_batch(report(finished=[finished(seq_id, FinishReason.EOS)]))
    assert sched.cancel(seq_id) is False
    assert sched.get_sequence(seq_id).finish_reason is FinishReason.EOS


def test_late_finish_report_of_a_cancelled_sequence_is_ignored():
    sched, _ = setup()
    seq_id = submit(sched)
    admit(sched)
    sched.cancel(seq_id)
    sched.select_batch(report(finished=[finished(seq_id, FinishReason.EOS, 3)]))
    info = sched.get_sequence(seq_id)
    assert info.finish_reason is FinishReason.CANCELLED and info.generated_tokens == 0


# ---------------------------------------------------------------- workers


def test_reregistration_requeues_everything_assigned_ahead_of_the_queue():
    sched, _ = setup(max_batch_size=2)
    a, b, c = submit(sched), submit(sched), submit(sched)
    admit(sched)
    register(sched, "w0")
    assert queue_order(sched, [a, b, c]) == [a, b, c]
    assert sched.status().workers[0].num_assigned == 0
    assert sched.get_sequence(a).worker_id == ""


def test_deregistration_requeues_to_the_head_and_removes_the_worker():
    sched, _ = setup(max_batch_size=1)
    a, b = submit(sched), submit(sched)
    admit(sched)
    assert sched.deregister_worker("w0") == 1
    assert queue_order(sched, [a, b]) == [a, b]
    with pytest.raises(UnknownWorker):
        sched.select_batch(report())


def test_expired_lease_requeues_to_the_head_and_refuses_the_worker_until_it_registers():
    sched, clock = setup(num_workers=2, max_batch_size=1, lease_ttl_ms=1000)
    a, b = submit(sched), submit(sched)
    assert admit(sched, "w0", gdn_free_slots=1) == (a,)
    clock.advance_ms(600)
    sched.select_batch(report("w1", gdn_free_slots=0))  # w1 stays alive
    clock.advance_ms(600)  # w0 has been silent for 1200 ms
    sched.select_batch(report("w1", gdn_free_slots=0))
    assert queue_order(sched, [a, b]) == [a, b]
    assert [w.worker_id for w in sched.status().workers] == ["w1"]
    with pytest.raises(UnknownWorker):
        sched.select_batch(report("w0", waiting=[a]))
    register(sched, "w0")
    assert admit(sched, "w0") == (a,)


def test_each_call_renews_the_lease():
    sched, clock = setup(lease_ttl_ms=1000)
    seq_id = submit(sched)
    admit(sched)
    for _ in range(5):
        clock.advance_ms(900)
        sched.select_batch(report(waiting=[seq_id]))
    assert sched.get_sequence(seq_id).worker_id == "w0"


def test_expire_leases_returns_the_dropped_workers():
    sched, clock = setup(num_workers=2, lease_ttl_ms=1000)
    clock.advance_ms(500)
    sched.select_batch(report("w1"))
    clock.advance_ms(700)
    assert sched.expire_leases() == ["w0"]


# ----------------------------------------------------------- tokens and resumption


def test_resumed_spec_is_prompt_plus_generated_tokens_with_the_remaining_budget():
    sched, _ = setup()
    seq_id = submit(sched, prompt_len=5, max_new_tokens=10)
    admit(sched)
    sched.select_batch(report(running=[seq_id], tokens={seq_id: [70, 71]}))
    sched.select_batch(report(preempted=[seq_id], tokens={seq_id: [72]}, gdn_free_slots=0))
    chunk = sched.select_batch(report()).prefill[0]
    assert chunk.spec.prompt_token_ids == (1, 2, 3, 4, 5, 70, 71, 72)
    assert chunk.spec.max_new_tokens == 7
    assert (chunk.chunk_start, chunk.chunk_len) == (0, 8)


def test_resumed_prefill_chunks_cover_the_extended_prompt():
    sched, _ = setup(chunk_size=4)
    seq_id = submit(sched, prompt_len=4, max_new_tokens=10)
    admit(sched)
    sched.select_batch(report(running=[seq_id], tokens={seq_id: [70, 71, 72]}))
    register(sched, "w0")  # the worker restarted
    assert sched.select_batch(report()).prefill[0].chunk_len == 4
    continuation = sched.select_batch(report(waiting=[seq_id])).prefill[0]
    assert (continuation.chunk_start, continuation.chunk_len) == (4, 3)


def test_output_after_resumption_has_no_token_twice():
    sched, _ = setup()
    seq_id = submit(sched, prompt_len=3, max_new_tokens=5)
    admit(sched)
    sched.select_batch(report(running=[seq_id], tokens={seq_id: [10, 11]}))
    sched.select_batch(report(preempted=[seq_id], gdn_free_slots=0))
    admit(sched)
    sched.select_batch(report(running=[seq_id], tokens={seq_id: [12]}))
    sched.select_batch(
        report(finished=[finished(seq_id, FinishReason.EOS, 1)], tokens={seq_id: [13]})
    )
    view = sched.read_output(seq_id, 0)
    assert view.token_ids == (10, 11, 12, 13)
    assert view.finished and view.finish_reason is FinishReason.EOS
    assert sched.read_output(seq_id, 3).token_ids == (13,)
    assert sched.get_sequence(seq_id).generated_tokens == 4


def test_tokens_from_a_worker_that_does_not_hold_the_sequence_are_ignored():
    sched, _ = setup(num_workers=2)
    seq_id = submit(sched)
    admit(sched, "w0")
    sched.select_batch(report("w1", tokens={seq_id: [99]}))
    assert sched.read_output(seq_id, 0).token_ids == ()


def test_generated_tokens_counts_tokens_reported_across_calls():
    sched, _ = setup()
    seq_id = submit(sched, max_new_tokens=10)
    admit(sched)
    sched.select_batch(report(running=[seq_id], tokens={seq_id: [1]}))
    assert sched.get_sequence(seq_id).generated_tokens == 1
    sched.select_batch(report(running=[seq_id], tokens={seq_id: [2, 3]}))
    assert sched.get_sequence(seq_id).generated_tokens == 3


def test_generated_tokens_counts_the_reported_tokens_when_the_finish_counts_none():
    sched, _ = setup()
    seq_id = submit(sched, max_new_tokens=10)
    admit(sched)
    sched.select_batch(report(running=[seq_id], tokens={seq_id: [5, 6]}))
    sched.select_batch(report(finished=[finished(seq_id, FinishReason.EOS, 0)]))
    assert sched.get_sequence(seq_id).generated_tokens == 2


@pytest.mark.parametrize("num_reported", [2, 3])
def test_requeued_sequence_with_every_token_generated_finishes_with_max_length(num_reported):
    # Resuming it would ask a worker for max_new_tokens <= 0 (not valid on the wire).
    sched, _ = setup()
    seq_id = submit(sched, prompt_len=3, max_new_tokens=2)
    admit(sched)
    tokens = [7, 8, 9][:num_reported]
    sched.select_batch(report(running=[seq_id], tokens={seq_id: tokens}))
    sched.select_batch(report(preempted=[seq_id], gdn_free_slots=0))
    info = sched.get_sequence(seq_id)
    assert info.state is SequenceState.FINISHED
    assert info.finish_reason is FinishReason.MAX_LENGTH
    assert sched.status().queue_depth == 0
    assert sched.select_batch(report()).prefill == ()


def test_requeued_sequence_with_tokens_left_is_resumed_not_finished():
    sched, _ = setup()
    seq_id = submit(sched, prompt_len=3, max_new_tokens=3)
    admit(sched)
    sched.select_batch(report(running=[seq_id], tokens={seq_id: [7, 8]}))
    register(sched, "w0")
    assert sched.get_sequence(seq_id).state is SequenceState.QUEUED
    assert sched.select_batch(report()).prefill[0].spec.max_new_tokens == 1


def test_deregistration_counts_only_what_went_back_to_the_queue():
    sched, _ = setup()
    done, resumable = submit(sched, max_new_tokens=1), submit(sched, max_new_tokens=5)
    admit(sched)
    sched.select_batch(report(running=[done, resumable], tokens={done: [7], resumable: [8]}))
    assert sched.deregister_worker("w0") == 1
    assert sched.get_sequence(done).finish_reason is FinishReason.MAX_LENGTH
    assert sched.get_sequence(resumable).state is SequenceState.QUEUED


def test_a_scheduler_that_stood_still_does_not_count_it_against_the_leases():
    clock = FakeClock()
    sched = Scheduler(make_config(lease_ttl_ms=1000), clock=clock, stall_seconds=0.5)
    register(sched, "w0")
    register(sched, "w1")
    seq_id = submit(sched)
    admit(sched, "w0")
    sched.expire_leases()
    clock.advance_ms(3000)  # frozen: no check ran for 3 s, though the workers kept calling
    assert sched.expire_leases() == []
    assert sched.get_sequence(seq_id).worker_id == "w0"
    # Once running again, silence counts as before.
    for _ in range(3):
        clock.advance_ms(400)
        sched.expire_leases()
    assert [w.worker_id for w in sched.status().workers] == []


def test_a_scheduler_that_stood_still_does_not_count_it_in_a_workers_call_gap():
    # Placement waits for a holder up to its usual gap between calls; a stall of the
    # scheduler's own is not the worker's gap.
    clock = FakeClock()
    sched = Scheduler(make_config(lease_ttl_ms=10_000), clock=clock, stall_seconds=0.5)
    register(sched, "w0")
    seq_id = submit(sched, max_new_tokens=100)
    admit(sched, "w0")
    for _ in range(4):
        clock.advance_ms(50)
        sched.expire_leases()
        sched.select_batch(report(running=[seq_id], tokens={seq_id: [7]}))
    gaps = sched._ledger.get("w0").call_gaps
    before = gaps.bound_seconds()
    assert 0.04 < before < 0.1
    clock.advance_ms(3000)  # frozen: the worker's calls could not be heard
    sched.expire_leases()
    clock.advance_ms(50)
    sched.select_batch(report(running=[seq_id], tokens={seq_id: [7]}))
    assert gaps.bound_seconds() <= before  # another 50 ms gap, not 3.05 s


def test_without_stall_detection_every_gap_counts():
    clock = FakeClock()
    sched = Scheduler(make_config(lease_ttl_ms=1000), clock=clock)
    register(sched, "w0")
    sched.expire_leases()
    clock.advance_ms(3000)
    assert sched.expire_leases() == ["w0"]
