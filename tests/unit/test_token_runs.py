"""The packed form of a report's tokens (TokenRuns) gives the sequences exactly
what the same tokens as TokenUpdates give: offsets make retries idempotent, a gap refuses
the report whole, several runs of one sequence add up, arrays that do not line up are
refused naming the field."""

import pytest

from service.core import InvalidArgument, TokenRuns, TokenUpdate, WorkerReport
from tests.unit.factories import admit, make_scheduler, register, submit


def _running(num: int = 2):
    sched = make_scheduler()
    register(sched)
    seq_ids = [submit(sched, prompt_len=4, max_new_tokens=20) for _ in range(num)]
    admit(sched)
    return sched, tuple(seq_ids)


def _report(sched, running, runs=TokenRuns(), tokens=()):
    return sched.select_batch(
        WorkerReport(
            "w0",
            running=running,
            kv_free_pages=100,
            gdn_free_slots=8,
            tokens=tokens,
            token_runs=runs,
        )
    )


def _outputs(sched, seq_ids):
    return [sched.read_output(s, 0).token_ids for s in seq_ids]


@pytest.mark.parametrize("packed", [False, True])
def test_one_token_each_reads_as_the_same_token_updates(packed):
    sched, (a, b) = _running()
    for step, (ta, tb) in enumerate([(11, 21), (12, 22)]):
        if packed:
            _report(sched, (a, b), TokenRuns((a, b), (ta, tb), offsets=(step, step)))
        else:
            _report(
                sched, (a, b), tokens=(TokenUpdate(a, (ta,), step), TokenUpdate(b, (tb,), step))
            )
    assert _outputs(sched, (a, b)) == [(11, 12), (21, 22)]


def test_runs_with_counts_and_a_retry_by_offset_add_nothing_twice():
    sched, (a, b) = _running()
    runs = TokenRuns((a, b), (11, 12, 21), counts=(2, 1), offsets=(0, 0))
    _report(sched, (a, b), runs)
    _report(sched, (a, b), runs)  # the retry of a report whose answer was lost
    # The retry merged with what came since: only the new part is kept.
    _report(sched, (a, b), TokenRuns((a, b), (11, 12, 13, 22), counts=(3, 1), offsets=(0, 1)))
    assert _outputs(sched, (a, b)) == [(11, 12, 13), (21, 22)]


def test_both_forms_in_one_report_apply_tokens_first():
    sched, (a, b) = _running()
    _report(sched, (a, b), TokenRuns((a, a), (12, 13)), tokens=(TokenUpdate(a, (11,)),))
    assert _outputs(sched, (a, b)) == [(11, 12, 13), ()]


def test_a_gap_in_the_runs_refuses_the_whole_report():
    sched, (a, b) = _running()
    with pytest.raises(InvalidArgument, match=r"token_offsets\[1\]: seq_id .* offset 5 is beyond"):
        _report(sched, (a, b), TokenRuns((a, b), (11, 21), offsets=(0, 5)))
    assert _outputs(sched, (a, b)) == [(), ()]


@pytest.mark.parametrize(
    "runs, field",
    [
        (TokenRuns((1, 2), (11, 12, 13)), "token_ids holds 3 tokens"),
        (TokenRuns((1, 2), (11, 12, 13), counts=(2,)), "token_counts holds 1 entries"),
        (TokenRuns((1, 2), (11, 12), offsets=(0,)), "token_offsets holds 1 entries"),
    ],
)
def test_arrays_that_do_not_line_up_are_refused_naming_the_field(runs, field):
    sched, (a, b) = _running()
    with pytest.raises(InvalidArgument, match=field):
        _report(sched, (a, b), runs)


def test_one_token_runs_retried_or_mixed_with_strays_keep_each_token_once():
    """A steady step (one token per sequence, offsets sent) has a fast path; a retry, a
    stray id, a sequence named twice and a gap each leave it for the general rules,
    with the same outcome as TokenUpdates."""
    sched, (a, b) = _running()
    step = TokenRuns((a, b), (11, 21), offsets=(0, 0))
    _report(sched, (a, b), step)
    _report(sched, (a, b), step)  # retried: nothing twice
    _report(sched, (a, b), TokenRuns((a, 999, b), (12, 7, 22), offsets=(1, 0, 1)))  # a stray
    _report(sched, (a, b), TokenRuns((a, a, b), (13, 14, 23), offsets=(2, 3, 2)))  # a twice
    with pytest.raises(InvalidArgument, match=r"token_offsets\[0\]: seq_id .* offset 9"):
        _report(sched, (a, b), TokenRuns((a, b), (15, 24), offsets=(9, 3)))
    _report(sched, (a, b), TokenRuns((a, b), (15, 24)))  # no offsets: appended as sent
    assert _outputs(sched, (a, b)) == [(11, 12, 13, 14, 15), (21, 22, 23, 24)]
