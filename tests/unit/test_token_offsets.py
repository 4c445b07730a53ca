"""Token updates that carry an offset are idempotent: a retried report adds nothing twice."""

from hypothesis import given, settings
from hypothesis import strategies as st

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


def _finishing(**fields) -> WorkerReport:
    """A report of w0 that holds nothing more (its sequence finishes in it)."""
    return WorkerReport("w0", kv_free_pages=100, gdn_free_slots=8, **fields)


def test_a_finish_counting_more_tokens_than_reported_is_refused_and_nothing_applied():
    """Regression (outside probe): a finish counting 7 tokens after 6 were reported was
    accepted (the client's stream had 6, the scheduler recorded 7; 2**32-1 was capped)."""
    import pytest

    from service.core import FinishReason, InvalidArgument
    from tests.unit.factories import finished

    sched, seq_id = _running_sequence()  # max_new_tokens=10
    _tokens(sched, seq_id, TokenUpdate(seq_id, (1, 2), offset=0))
    iteration = sched.status().workers[0].iteration
    for count in (4, 2**32 - 1):
        lying = _finishing(
            tokens=(TokenUpdate(seq_id, (3,), offset=2),),
            finished=(finished(seq_id, FinishReason.EOS, count),),
        )
        with pytest.raises(InvalidArgument, match=r"^finished\[0\]\.generated_tokens: "):
            sched.select_batch(lying)
    assert sched.read_output(seq_id, 0).token_ids == (1, 2)
    assert sched.get_sequence(seq_id).finish_reason is None
    assert sched.status().workers[0].iteration == iteration


def test_after_a_resume_a_finish_counts_the_tokens_of_this_assignment_only():
    from service.core import FinishReason
    from tests.unit.factories import finished

    sched, seq_id = _running_sequence()
    _tokens(sched, seq_id, TokenUpdate(seq_id, (11, 12, 13), offset=0))
    sched.select_batch(report(preempted=(seq_id,), gdn_free_slots=0))
    admit(sched)  # resumed with 3 of 10 tokens done: 7 may follow
    sched.select_batch(
        _finishing(
            tokens=(TokenUpdate(seq_id, (14, 15), offset=0),),
            finished=(finished(seq_id, FinishReason.EOS, 2),),
        )
    )
    info = sched.get_sequence(seq_id)
    assert (info.generated_tokens, info.finish_reason) == (5, FinishReason.EOS)


@settings(max_examples=200, deadline=None)
@given(
    chunks=st.lists(st.integers(0, 3), min_size=1, max_size=4),
    packed=st.booleans(),
    extra=st.integers(-3, 3),
)
def test_a_finish_is_accepted_exactly_when_it_counts_at_most_the_tokens_reported(
    chunks, packed, extra
):
    """Property: whatever the updates (plain or packed, with offsets, a retried token),
    a finish counting more than the tokens reported since admission is refused with
    nothing applied; any count up to them finishes the sequence with those tokens."""
    from service.core import FinishReason, InvalidArgument, TokenRuns
    from tests.unit.factories import finished

    sched, seq_id = _running_sequence()
    num_sent = 0
    for num in chunks[:-1]:  # earlier reports
        ids = tuple(range(num_sent, num_sent + num))
        _tokens(sched, seq_id, TokenUpdate(seq_id, ids, offset=num_sent))
        num_sent += num
    num_before = num_sent
    # The last report repeats one token already applied (a retry) and adds chunks[-1].
    offset = max(0, num_sent - 1)
    ids = tuple(range(offset, num_sent + chunks[-1]))
    num_sent += chunks[-1]
    count = max(0, num_sent + extra)
    fin = (finished(seq_id, FinishReason.EOS, count),)
    if packed:
        runs = TokenRuns((seq_id,), ids, (len(ids),), (offset,)) if ids else TokenRuns()
        last = _finishing(token_runs=runs, finished=fin)
    else:
        last = _finishing(tokens=(TokenUpdate(seq_id, ids, offset=offset),), finished=fin)
    if count > num_sent:
        try:
            sched.select_batch(last)
        except InvalidArgument as err:
            assert "generated_tokens" in str(err)
        else:
            raise AssertionError("a finish counting unreported tokens was accepted")
        assert sched.get_sequence(seq_id).finish_reason is None
        assert len(sched.read_output(seq_id, 0).token_ids) == num_before
    else:
        sched.select_batch(last)
        info = sched.get_sequence(seq_id)
        assert (info.finish_reason, info.generated_tokens) == (FinishReason.EOS, num_sent)
