"""The seed's 13 FifoScheduler tests, ported to the service's core.

The seed enqueued bare SeqIds and reported ids it never assigned; here every id a
worker reports was first submitted and admitted to that worker (an unassigned id
would be evicted), and then the seed's call is made.
"""

from service.core import PrefillChunk, SequenceState

from .factories import admit, make_scheduler, prefill_ids, register, report, submit


def scheduler(max_batch_size=32, chunk_size=512, prefill_reserve_pages=8):
    sched = make_scheduler(
        max_batch_size=max_batch_size,
        chunk_size=chunk_size,
        prefill_reserve_pages=prefill_reserve_pages,
    )
    register(sched, "w0")
    return sched


def running_on_w0(sched, num_seqs, prompt_len=8):
    """Admit `num_seqs` single-chunk sequences to w0; they are ready to decode."""
    seq_ids = [submit(sched, prompt_len) for _ in range(num_seqs)]
    assert admit(sched, "w0") == tuple(seq_ids)
    return seq_ids


# --- Empty state ---


def test_empty_state_returns_empty_decision():
    sched = scheduler()
    decision = sched.select_batch(report("w0"))
    assert decision.prefill == ()
    assert decision.decode == ()
    assert decision.evict == ()


# --- Admission ---


def test_new_sequence_admitted_into_prefill():
    sched = scheduler()
    seq_id = submit(sched, prompt_len=600)
    decision = sched.select_batch(report("w0"))
    assert len(decision.prefill) == 1
    chunk = decision.prefill[0]
    assert (chunk.seq_id, chunk.chunk_start, chunk.chunk_len) == (seq_id, 0, 512)  # chunk_size
    assert chunk.spec is not None and len(chunk.spec.prompt_token_ids) == 600


def test_admission_respects_max_batch_size():
    sched = scheduler(max_batch_size=2, prefill_reserve_pages=0)
    seq_ids = [submit(sched) for _ in range(3)]  # the third is over capacity
    decision = sched.select_batch(report("w0"))
    assert prefill_ids(decision) == seq_ids[:2]
    assert sched.status().queue_depth == 1
    assert sched.get_sequence(seq_ids[2]).state is SequenceState.QUEUED


def test_admission_refuses_when_active_count_full():
    sched = scheduler(max_batch_size=2, prefill_reserve_pages=0)
    running = running_on_w0(sched, 2)
    late = submit(sched)
    # Capacity = max_batch_size(2) - running(2) = 0: no new admissions.
    decision = sched.select_batch(report("w0", running=running))
    assert decision.prefill == ()
    assert sched.status().queue_depth == 1
    assert sched.get_sequence(late).state is SequenceState.QUEUED


def test_admission_blocked_by_memory_guard():
    sched = scheduler(max_batch_size=32, chunk_size=512, prefill_reserve_pages=8)
    long_seq = submit(sched, prompt_len=1024)  # two chunks: still waiting after the first
    assert admit(sched, "w0") == (long_seq,)
    submit(sched)
    # kv_free_pages < prefill_reserve_pages and active_count > 0.
    decision = sched.select_batch(report("w0", waiting=[long_seq], kv_free_pages=3))
    # The seed asserted a sentinel chunk_start (usize::MAX); the service knows the
    # prompt, so the continuation carries the real cursor.
    assert decision.prefill == (PrefillChunk(long_seq, 512, 512),)
    assert sched.status().queue_depth == 1


def test_admission_allowed_when_batch_empty_despite_low_pages():
    sched = scheduler(max_batch_size=32, chunk_size=512, prefill_reserve_pages=8)
    seq_id = submit(sched)
    # active_count == 0 bypasses the memory guard.
    decision = sched.select_batch(report("w0", kv_free_pages=0))
    assert prefill_ids(decision) == [seq_id]


# --- Decode ---


def test_running_sequences_go_to_decode():
    sched = scheduler()
    running = running_on_w0(sched, 2)
    decision = sched.select_batch(report("w0", running=running))
    assert decision.decode == tuple(running)


def test_all_running_sequences_decode_regardless_of_free_gdn_slots():
    sched = scheduler()
    running = running_on_w0(sched, 3)
    # Running sequences already hold their GDN slots: 0 free slots gates only admissions.
    decision = sched.select_batch(report("w0", running=running, gdn_free_slots=0))
    assert decision.decode == tuple(running)


# --- Prefill continuation ---


def test_waiting_sequences_get_continuation_chunk():
    sched = scheduler(max_batch_size=32, chunk_size=128, prefill_reserve_pages=0)
    seq_id = submit(sched, prompt_len=300)
    assert admit(sched, "w0") == (seq_id,)
    decision = sched.select_batch(report("w0", waiting=[seq_id]))
    # The seed asserted a sentinel chunk_start (usize::MAX); here it is the real
    # cursor: the first 128 prompt tokens were handed out with the admission.
    assert decision.prefill == (PrefillChunk(seq_id, 128, 128, spec=None),)


def test_no_duplicate_seqid_in_prefill_between_new_and_waiting():
    sched = scheduler(max_batch_size=32, chunk_size=512, prefill_reserve_pages=0)
    waiting = submit(sched, prompt_len=1024)
    assert admit(sched, "w0") == (waiting,)
    new = submit(sched)  # not in waiting
    decision = sched.select_batch(report("w0", waiting=[waiting]))
    ids = prefill_ids(decision)
    assert ids == [new, waiting]  # new admissions come before continuations
    assert len(ids) == len(set(ids))


# --- Eviction ---


def test_phase1_no_evictions():
    # No evictions for sequences that are assigned to the worker and running.
    sched = scheduler()
    running = running_on_w0(sched, 1)
    decision = sched.select_batch(report("w0", running=running))
    assert decision.evict == ()
    assert decision.decode == tuple(running)


# --- on_preempt: the service requeues instead of a no-op ---


def test_on_preempt_puts_sequence_back_at_head_of_queue():
    sched = scheduler(max_batch_size=1, prefill_reserve_pages=0)
    first = submit(sched)
    second = submit(sched)
    assert admit(sched, "w0") == (first,)
    # No free GDN slot, so nothing is admitted in the same call.
    sched.select_batch(report("w0", preempted=[first], gdn_free_slots=0))
    info = sched.get_sequence(first)
    assert info.state is SequenceState.QUEUED and info.queue_position == 0
    assert sched.get_sequence(second).queue_position == 1
    decision = sched.select_batch(report("w0"))
    assert [(c.seq_id, c.chunk_start, c.spec is not None) for c in decision.prefill] == [
        (first, 0, True)
    ]


# --- Chunk size propagation ---


def test_chunk_size_propagated_to_new_admissions():
    sched = make_scheduler(max_batch_size=32, chunk_size=256, prefill_reserve_pages=0)
    assert register(sched, "w0").chunk_size == 256
    submit(sched, prompt_len=1000)
    decision = sched.select_batch(report("w0"))
    assert decision.prefill[0].chunk_len == 256
