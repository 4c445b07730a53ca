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
    sched.select_batch(
        WorkerReport("w0", running=(seq_id,), kv_free_pages=100, gdn_free_slots=8, tokens=updates)
    )


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


def test_an_offset_beyond_the_known_tokens_is_refused_and_nothing_of_the_report_applied():
    """Regression (outside probe): offset 50 with 5 tokens known was appended at position 5;
    a gap means tokens were lost on the way, so the report is refused whole."""
    import pytest

    from service.core import FinishReason, InvalidArgument
    from tests.unit.factories import finished

    sched, seq_id = _running_sequence()
    other = submit(sched, prompt_len=4, max_new_tokens=10)
    admit(sched)
    _tokens(sched, seq_id, TokenUpdate(seq_id, (1, 2, 3, 4, 5), offset=0))
    iteration = sched.status().workers[0].iteration
    gap = WorkerReport(
        "w0",
        running=(seq_id,),
        kv_free_pages=100,
        gdn_free_slots=8,
        tokens=(TokenUpdate(other, (9,), offset=0), TokenUpdate(seq_id, (6,), offset=50)),
        finished=(finished(other, FinishReason.EOS, 1),),
    )
    with pytest.raises(
        InvalidArgument,
        match=r"^tokens\[1\]: seq_id \d+ offset 50 is beyond "
        r"the 5 tokens known",
    ):
        sched.select_batch(gap)
    assert sched.read_output(seq_id, 0).token_ids == (1, 2, 3, 4, 5)
    assert sched.read_output(other, 0).token_ids == ()
    assert sched.get_sequence(other).finish_reason is None
    assert sched.status().workers[0].iteration == iteration


def test_an_offset_exactly_at_the_known_tokens_and_updates_that_chain_in_one_report_apply():
    sched, seq_id = _running_sequence()
    _tokens(
        sched,
        seq_id,
        TokenUpdate(seq_id, (1, 2), offset=0),
        TokenUpdate(seq_id, (3,), offset=2),
        TokenUpdate(seq_id, (4,), offset=3),
    )
    assert sched.read_output(seq_id, 0).token_ids == (1, 2, 3, 4)


def test_a_finish_counting_more_than_max_new_tokens_is_capped_at_max_new_tokens():
    """Regression (outside probe): generated_tokens 2**32-1 in a finish showed in GetSequence."""
    from service.core import FinishReason
    from tests.unit.factories import finished

    sched, seq_id = _running_sequence()  # max_new_tokens=10
    _tokens(sched, seq_id, TokenUpdate(seq_id, (1, 2), offset=0))
    sched.select_batch(report(finished=(finished(seq_id, FinishReason.EOS, 2**32 - 1),)))
    assert sched.get_sequence(seq_id).generated_tokens == 10


def test_after_a_resume_a_finish_count_is_capped_at_what_the_assignment_may_generate():
    from service.core import FinishReason
    from tests.unit.factories import finished

    sched, seq_id = _running_sequence()
    _tokens(sched, seq_id, TokenUpdate(seq_id, (11, 12, 13), offset=0))
    sched.select_batch(report(preempted=(seq_id,), gdn_free_slots=0))
    admit(sched)  # resumed with 3 of 10 tokens done: 7 may follow
    sched.select_batch(report(finished=(finished(seq_id, FinishReason.EOS, 1000),)))
    assert sched.get_sequence(seq_id).generated_tokens == 10
