"""Token updates that carry an offset are idempotent: a retried report adds nothing twice."""
from service.core import TokenUpdate, WorkerReport

from tests.unit.factories import admit, make_scheduler, register, report, submit


def _running_sequence():
    sched = make_scheduler()
    register(sched)
    seq_id = submit(sched, prompt_len=4, max_new_tokens=10)
    admit(sched)
    return sched, seq_id


def _tokens(sched, seq_id, *updates: TokenUpdate) -> None:
    sched.select_batch(WorkerReport("w0", running=(seq_id,), kv_free_pages=100,
                                    gdn_free_slots=8, tokens=updates))


def test_retried_token_update_with_offset_is_applied_once():
    sched, seq_id = _running_sequence()
    _tokens(sched, seq_id, TokenUpdate(seq_id, (11, 12), offset=0))
    _tokens(sched, seq_id, TokenUpdate(seq_id, (11, 12), offset=0))  # the retry
    _tokens(sched, seq_id, TokenUpdate(seq_id, (13,), offset=2))
    assert sched.read_output(seq_id, 0).token_ids == (11, 12, 13)


def test_retry_merged_with_new_tokens_keeps_only_the_new_part():
    sched, seq_id = _running_sequence()
    _tokens(sched, seq_id, TokenUpdate(seq_id, (11, 12), offset=0))
    # The answer to the call above was lost; the worker resends with what came since.
    _tokens(sched, seq_id, TokenUpdate(seq_id, (11, 12, 13, 14), offset=0))
    assert sched.read_output(seq_id, 0).token_ids == (11, 12, 13, 14)


def test_offsets_count_from_the_current_admission_after_a_resume():
    sched, seq_id = _running_sequence()
    _tokens(sched, seq_id, TokenUpdate(seq_id, (11, 12), offset=0))
    sched.select_batch(report(preempted=(seq_id,), gdn_free_slots=0))
    admit(sched)  # resumed: the spec now ends with 11, 12
    _tokens(sched, seq_id, TokenUpdate(seq_id, (13,), offset=0))
    _tokens(sched, seq_id, TokenUpdate(seq_id, (13,), offset=0))
    assert sched.read_output(seq_id, 0).token_ids == (11, 12, 13)


def test_updates_without_offset_are_appended_as_sent():
    sched, seq_id = _running_sequence()
    _tokens(sched, seq_id, TokenUpdate(seq_id, (11,)))
    _tokens(sched, seq_id, TokenUpdate(seq_id, (11,)))
    assert sched.read_output(seq_id, 0).token_ids == (11, 11)
    assert sched.get_sequence(seq_id).finish_reason is None
