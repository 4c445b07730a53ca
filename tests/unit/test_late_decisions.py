"""Late decisions on the core alone (docs/contract.md, "Late decisions"): a report with
`decide_later` is applied and answered with a decision that runs nothing; the worker's
next report gets the step's decision, and with it a prompt that arrived meanwhile."""

from __future__ import annotations

from dataclasses import replace

from service.core import TokenUpdate

from .factories import admit, make_scheduler, register, report, submit


def _running_one():
    sched = make_scheduler()
    register(sched)
    first = submit(sched)
    assert admit(sched) == (first,)
    return sched, first


def test_a_report_that_decides_later_is_applied_and_answered_with_nothing_to_run():
    sched, first = _running_one()
    later = replace(report(running=[first]), tokens=(TokenUpdate(first, (7,)),), decide_later=True)
    decision = sched.select_batch(later)
    assert (decision.prefill, decision.decode, decision.evict, decision.preempt) == ((),) * 4
    assert sched.get_sequence(first).generated_tokens == 1  # the tokens were applied


def test_a_prompt_that_arrives_before_the_second_report_is_admitted_by_it():
    sched, first = _running_one()
    sched.select_batch(replace(report(running=[first]), decide_later=True))
    second = submit(sched)  # while the worker's step runs
    decision = sched.select_batch(report(running=[first]))
    assert decision.decode == (first,)
    assert [c.seq_id for c in decision.prefill] == [second]


def test_a_report_that_must_evict_is_decided_at_once():
    sched, first = _running_one()
    sched.cancel(first)
    decision = sched.select_batch(replace(report(running=[first]), decide_later=True))
    assert decision.evict == (first,)


def test_a_draining_worker_is_decided_at_once():
    sched, first = _running_one()
    decision = sched.select_batch(
        replace(report(running=[first], draining=True), decide_later=True)
    )
    assert decision.decode == (first,)
